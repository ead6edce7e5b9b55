"""Replay a schedule on the GPU and hold the observed bytes against the simulator's.

Two modes (DESIGN.md, "Replay modes"):

* **controlled**: simulate item-atomically (``run_schedule(s, profile, torn=False, seed=...)``),
  turn that run into a race-free schedule that forces its interleaving
  (``sim.replay.controlled_schedule``: copies split at the observed item boundaries, events
  added), execute that on the GPU once, and require every read's observed bytes to equal the
  run's predicted bytes, byte for byte.  An interleaving that streams and events cannot force
  raises ``sim.replay.ReplayError``, reported as such (exit 2).
* **free**: execute the schedule unchanged ``trials`` times (buffers restored each time).  A read
  is *stale* in a trial when its bytes differ from the happens-before order's
  (``run_reference``).  Every observed 8-byte word must be one the read's position holds at some
  point of that order (``sim.replay.possible_provenance`` + ``plausible_words``): a word that is
  not is *implausible*, a bug in kvrace's model or in the kernel.  The stale fraction per read
  comes with a 95 % Wilson interval and beside it the simulator's prediction for the same
  schedule: the fraction of ``sim_seeds`` seeded runs (compute jitter, seeded tie-breaks, torn
  items) whose read is stale.

In both modes the guards are held against the simulator's predicted out-of-bounds writes per
buffer (``oob_detected``).  ``replay`` returns one JSON-serialisable dict; ``cli_replay`` is the
``kvrace replay`` command (exit 0 when everything agreed, 1 when something did not, 2 when the
schedule cannot be replayed: a ReplayError or a routine the provider does not support).

**Traces** (``kvrace replay --trace FILE``): ``replay_trace(schedule, report)`` rebuilds, from a
replay's report alone (no GPU: a committed ``results/*/*.json`` will do), the simulated run it
was held against and the GPU's measured timeline (``sim.trace.measured_timeline``), and puts both
in one Chrome trace-event document (``sim.trace.combined_trace``): Perfetto shows the simulated
tracks above the measured ones on one time axis.  Controlled mode times the controlled
schedule's ops (its split copies included); free mode times one extra run after the trials,
made only when ``replay(..., timeline=True)`` (the trials themselves are never timed: CUDA
events between ops would change the interleavings they measure).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from gpu_backend.compare import (compare_read, first_mismatch, gpu_expected_bytes, mismatch_text,
                                 oob_agreement, predicted_oob, wilson_interval)
from gpu_backend.providers.base import ProviderError
from sim.errors import InputError
from sim.executor import TieBreak, run_reference, run_schedule
from sim.profile import Profile, load_profile
from sim.replay import ReplayError, controlled_schedule, plausible_words, possible_provenance
from sim.schedule import Schedule, validate

MODES = ("controlled", "free")


def _default_runner(schedule, provider, *, guard_bytes=None):
    from gpu_backend.runner import GpuSchedule

    return GpuSchedule(schedule, provider, guard_bytes=guard_bytes)


def _provider_name(provider) -> str:
    return provider if isinstance(provider, str) else getattr(provider, "name", type(provider).__name__)


def _profile(profile) -> Profile:
    return profile if isinstance(profile, Profile) else load_profile(profile)


def _oob_section(schedule, guards) -> tuple[dict, bool]:
    agreement = oob_agreement(predicted_oob(schedule), guards)
    return agreement, all(e["agree"] for e in agreement.values())


def simulate_stale(schedule: Schedule, profile, *, seeds: int = 200, seed: int = 0) -> tuple[dict[str, int], int]:
    """Over ``seeds`` seeded simulator runs (compute jitter, seeded ties, torn items): how many saw
    each read stale (provenance different from the happens-before order's), and how many saw at
    least one read stale."""
    profile = _profile(profile)
    ref = run_reference(schedule, materialise=False)
    ref_views = {r.op_id: r.views for r in ref.reads}
    stale = {r.op_id: 0 for r in ref.reads}
    any_stale = 0
    for k in range(seeds):
        run = run_schedule(schedule, profile, seed=seed + k, ties=TieBreak("seeded", seed=seed + k),
                           materialise=False)
        hit = False
        for r in run.reads:
            if not all(a.compact.equals(b.compact) for a, b in zip(r.views, ref_views[r.op_id])):
                stale[r.op_id] += 1
                hit = True
        any_stale += hit
    return stale, any_stale


def replay(schedule: Schedule, provider, mode: str = "controlled", *, profile="h200", trials: int = 100,
           seed: int = 0, sim_seeds: int = 200, make_runner=None, guard_bytes: int | None = None,
           timeline: bool = False) -> dict:
    """Replay ``schedule`` on the GPU (see the module doc); returns the JSON report.

    ``provider`` is a provider or its name.  ``make_runner(schedule, provider, guard_bytes=...)``
    returns an object whose ``run(timings=, final=, guards=)`` gives a ``GpuRun`` (default:
    ``gpu_backend.runner.GpuSchedule``); tests inject a fake one.  ``timeline``: in free mode,
    one more run after the trials, timed, kept as ``report["timed_run"]`` (``replay_trace``
    draws it; controlled mode always keeps its timings).
    Raises ReplayError (controlled mode) and ProviderError (unsupported routine)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    make_runner = make_runner or _default_runner
    prof = _profile(profile)
    t_start = time.perf_counter()
    if mode == "controlled":
        rep = _controlled(schedule, provider, prof, seed, make_runner, guard_bytes)
    else:
        rep = _free(schedule, provider, prof, trials, seed, sim_seeds, make_runner, guard_bytes, timeline)
    rep["seed"] = seed                # replay_trace rebuilds the simulated run (and controlled schedule) from it
    rep["wall_s"] = round(time.perf_counter() - t_start, 3)
    return rep


def _header(schedule, provider, mode, prof, gpu) -> dict:
    return {"kvrace_replay": 1, "schedule": schedule.name, "schedule_digest": schedule.digest(),
            "provider": _provider_name(provider), "mode": mode, "device": gpu.device_name,
            "profile": prof.name, "profile_calibrated": prof.calibrated, "compute_kernel": gpu.compute,
            "start_gate": gpu.gate, "guard_bytes": gpu.guard_bytes}


def _controlled(s, provider, prof, seed, make_runner, guard_bytes) -> dict:
    run = run_schedule(s, prof, torn=False, seed=seed)
    doc = controlled_schedule(s, run)          # raises ReplayError when it cannot be forced
    cs = validate(doc)
    runner = make_runner(cs, provider, guard_bytes=guard_bytes)
    gpu = runner.run(timings=True, final=True, guards=True)
    table = run.memory.table
    reads = []
    for cap in run.reads:
        exp = gpu_expected_bytes(cap.views, table, guard_bytes=gpu.guard_bytes, ordinals=gpu.ordinals)
        reads.append(compare_read(gpu.reads[cap.op_id], cap, table, expected=exp,
                                  layout=s.buffers[cap.buffer].layout))
    buffers = {}
    for name in s.buffers:
        if name not in gpu.final:
            continue
        want = gpu_expected_bytes([run.memory.view(name, 0, s.buffers[name].nbytes)], table,
                                  guard_bytes=gpu.guard_bytes, ordinals=gpu.ordinals)
        got = gpu.final[name]
        buffers[name] = {"nbytes": int(want.size), "bytes_differing": int((got != want).sum())}
    oob, oob_ok = _oob_section(s, gpu.guards)
    first = next((r["first_mismatch"] for r in reads if not r["match"]), None)
    rep = _header(s, provider, "controlled", prof, gpu)
    rep.update({
        "controlled_schedule": {"ops": len(cs.ops), "copies": sum(o.op == "copy" for o in cs.ops),
                                "events": len(cs.events)},
        "reads_total": len(reads),
        "reads_matching": sum(r["match"] for r in reads),
        "first_mismatch": first,
        "reads": reads,
        "buffers_total": len(buffers),
        "buffers_matching": sum(b["bytes_differing"] == 0 for b in buffers.values()),
        "buffers": buffers,
        "oob_detected": oob,
        "oob_agree": oob_ok,
        "stale_fraction": None,
        "timings_us": {k: [round(a, 3), round(b, 3)] for k, (a, b) in gpu.timings_us.items()},
    })
    rep["ok"] = rep["reads_matching"] == rep["reads_total"] and oob_ok
    return rep


def _free(s, provider, prof, trials, seed, sim_seeds, make_runner, guard_bytes, timeline=False) -> dict:
    if trials < 1:
        raise ValueError(f"trials: expected >= 1, got {trials}")
    ref = run_reference(s)
    table = ref.memory.table
    states = possible_provenance(s)
    runner = make_runner(s, provider, guard_bytes=guard_bytes)
    warm = runner.run(timings=False, final=False, guards=False)      # first-use builds, clocks up
    expected = {cap.op_id: gpu_expected_bytes(cap.views, table, guard_bytes=warm.guard_bytes,
                                              ordinals=warm.ordinals) for cap in ref.reads}
    stale = {cap.op_id: 0 for cap in ref.reads}
    implausible = {cap.op_id: 0 for cap in ref.reads}
    trials_implausible = {cap.op_id: 0 for cap in ref.reads}
    first = None
    oob_runs_agreeing = 0
    oob = None
    any_stale_trials = 0
    gate_timeouts = 0
    for t in range(trials):
        gpu = runner.run(timings=False, final=False, guards=True)
        gate_timeouts += "timed out" in getattr(gpu, "gate", "")
        trial_stale = False
        for cap in ref.reads:
            obs = gpu.reads[cap.op_id]
            exp = expected[cap.op_id]
            if not np.array_equal(obs, exp):
                stale[cap.op_id] += 1
                trial_stale = True
            ok = plausible_words(obs, states[cap.op_id])
            bad = int((~ok).sum())
            if bad:
                implausible[cap.op_id] += bad
                trials_implausible[cap.op_id] += 1
                if first is None:
                    k = int(np.flatnonzero(~ok)[0]) * 8
                    first = first_mismatch(obs, cap, table, k, expected=exp,
                                           layout=s.buffers[cap.buffer].layout)
                    first.update(trial=t, kind="implausible word")
        any_stale_trials += trial_stale
        this_oob, agree = _oob_section(s, gpu.guards)
        oob_runs_agreeing += agree
        if oob is None or not agree:
            oob = this_oob
    sim_stale, sim_any = simulate_stale(s, prof, seeds=sim_seeds, seed=seed) if sim_seeds > 0 else ({}, 0)
    reads = []
    for cap in ref.reads:
        k = stale[cap.op_id]
        lo, hi = wilson_interval(k, trials)
        entry = {"op": cap.op_id, "buffer": cap.buffer, "nbytes": cap.nbytes, "trials": trials,
                 "stale_trials": k, "stale_fraction": k / trials, "stale_ci95": [lo, hi],
                 "implausible_words": implausible[cap.op_id],
                 "trials_with_implausible_words": trials_implausible[cap.op_id],
                 "plausible": implausible[cap.op_id] == 0}
        if sim_seeds > 0:
            ks = sim_stale[cap.op_id]
            entry.update(simulated_runs=sim_seeds, simulated_stale_runs=ks,
                         simulated_stale_fraction=ks / sim_seeds,
                         simulated_stale_ci95=list(wilson_interval(ks, sim_seeds)))
        reads.append(entry)
    rep = _header(s, provider, "free", prof, warm)
    lo, hi = wilson_interval(any_stale_trials, trials)
    rep.update({
        "trials": trials,
        "reads_total": len(reads),
        "reads_matching": sum(r["plausible"] for r in reads),
        "first_mismatch": first,
        "implausible_words": sum(implausible.values()),
        "stale_fraction": any_stale_trials / trials,
        "stale_ci95": [lo, hi],
        "simulated_stale_fraction": sim_any / sim_seeds if sim_seeds > 0 else None,
        "simulator_seeds": sim_seeds,
        "reads": reads,
        "oob_detected": oob or {},
        "oob_agree": oob_runs_agreeing == trials,
        "oob_trials_agreeing": oob_runs_agreeing,
        "gate_timeouts": gate_timeouts,
    })
    if timeline:
        rep["timed_run"] = _timed_free_run(runner, ref, expected, states)
    rep["ok"] = rep["implausible_words"] == 0 and rep["oob_agree"]
    return rep


def _timed_free_run(runner, ref, expected, states) -> dict:
    """One more free run, its ops timed: each read ``clean`` (the happens-before order's bytes),
    ``stale`` (other bytes, every word plausible) or ``implausible``."""
    gpu = runner.run(timings=True, final=False, guards=False)
    reads = {}
    for cap in ref.reads:
        obs = gpu.reads[cap.op_id]
        if np.array_equal(obs, expected[cap.op_id]):
            reads[cap.op_id] = "clean"
        else:
            reads[cap.op_id] = "stale" if plausible_words(obs, states[cap.op_id]).all() else "implausible"
    return {"timings_us": {k: [round(a, 3), round(b, 3)] for k, (a, b) in gpu.timings_us.items()}, "reads": reads}


# ---------------------------------------------------------------- traces

def replay_timelines(schedule: Schedule, rep: dict, *, profile=None, seed: int | None = None) -> list:
    """``[(label, simulated Timeline), (label, measured Timeline)]`` of a replay report.

    The simulated run is the one the replay was held against: controlled mode, the item-atomic
    run (``torn=False``) whose interleaving was forced; free mode, one seeded run (seeded ties,
    torn items).  ``profile`` and ``seed`` default to the report's (a report without a seed,
    made before it was recorded, used the default 0).  The measured timeline is the controlled
    schedule's timed run (controlled mode) or ``rep["timed_run"]`` (free mode); each read is
    marked with what the GPU saw: in controlled mode the predicted status when its bytes matched
    the prediction, ``mismatch`` otherwise; in free mode ``clean``, ``stale`` or ``mismatch``
    (an implausible word).  Raises InputError when the report cannot be drawn (another
    schedule, a free-mode report without a timed run, timings the rebuilt controlled schedule
    does not have)."""
    from sim.trace import measured_timeline, timeline
    from sim.verdicts import analyse

    where = "replay report"
    if rep.get("kvrace_replay") != 1 or rep.get("mode") not in MODES:
        raise InputError(where, f"expected a kvrace replay report (kvrace_replay: 1, mode in {MODES})")
    if rep.get("schedule_digest") not in (None, schedule.digest()):
        raise InputError(where, f"it replayed schedule {rep.get('schedule')!r} with another digest; expected a "
                         f"report of {schedule.name!r} as it is now")
    prof = _profile(profile if profile is not None else rep.get("profile", "h200"))
    seed = rep.get("seed", 0) if seed is None else seed
    measured_label = f"measured on {rep.get('device', 'GPU')} ({rep.get('provider')}, {rep['mode']})"
    if rep["mode"] == "controlled":
        run = run_schedule(schedule, prof, torn=False, seed=seed)
        sim_rep = analyse(run)
        gpu_schedule = validate(controlled_schedule(schedule, run))
        timings = rep.get("timings_us") or {}
        predicted = {r["op"]: ("clean" if r["status"] == "ok" else r["status"]) for r in sim_rep["reads"]}
        statuses = {}
        for r in rep.get("reads", []):
            want = predicted.get(r["op"], "clean")
            shown = "clean" if want == "clean" else want.upper()
            statuses[r["op"]] = ((want, f"{shown} read {r['op']}: GPU bytes equal the prediction")
                                 if r["match"] else
                                 ("mismatch", f"MISMATCH read {r['op']}: {r['bytes_differing']} bytes differ from "
                                  "the prediction"))
        sim_label = f"simulated ({prof.name}, seed {seed}, item-atomic: the forced interleaving)"
    else:
        if "timed_run" not in rep:
            raise InputError(where, "a free-mode report has no timed run; expected one made with --trace "
                             "(replay(..., timeline=True))")
        run = run_schedule(schedule, prof, seed=seed, ties=TieBreak("seeded", seed=seed))
        sim_rep = analyse(run)
        gpu_schedule = schedule
        timings = rep["timed_run"]["timings_us"]
        words = {"clean": "clean read {}", "stale": "STALE read {}: not the happens-before order's bytes",
                 "implausible": "MISMATCH read {}: a word the simulator deems impossible"}
        statuses = {op: ("mismatch" if st == "implausible" else st, words[st].format(op))
                    for op, st in rep["timed_run"]["reads"].items()}
        sim_label = f"simulated ({prof.name}, seed {seed})"
    known = {op.id for op in gpu_schedule.ops}
    missing = sorted(set(timings) - known)
    if missing:
        raise InputError(where, f"its timings name ops {missing[:5]} that the schedule rebuilt with profile "
                         f"{prof.name!r} and seed {seed} does not have; expected the profile and seed of the replay")
    measured = measured_timeline(gpu_schedule, {k: tuple(v) for k, v in timings.items()}, statuses,
                                 name=f"{schedule.name} ({rep['mode']} replay)", source=rep.get("device"))
    return [(sim_label, timeline(run, sim_rep)), (measured_label, measured)]


def replay_trace(schedule: Schedule, rep: dict, *, profile=None, seed: int | None = None) -> dict:
    """The Chrome trace-event document of a replay: the simulated run's processes above the
    measured ones (``replay_timelines``, ``sim.trace.combined_trace``)."""
    from sim.trace import combined_trace

    return combined_trace(replay_timelines(schedule, rep, profile=profile, seed=seed))


# ---------------------------------------------------------------- text and CLI

def summary_text(rep: dict) -> str:
    lines = [f"replay {rep['schedule']} on {rep['device']} (provider {rep['provider']}, mode {rep['mode']}, "
             f"profile {rep['profile']}{'' if rep['profile_calibrated'] else ', uncalibrated'})",
             f"  compute: {rep['compute_kernel']}; start gate: {rep['start_gate']}; guards {rep['guard_bytes']} B"]
    if rep["mode"] == "controlled":
        cs = rep["controlled_schedule"]
        lines.append(f"  controlled schedule: {cs['ops']} ops, {cs['copies']} copies, {cs['events']} events")
        lines.append(f"reads: {rep['reads_matching']}/{rep['reads_total']} byte-exact; buffers: "
                     f"{rep['buffers_matching']}/{rep['buffers_total']} final bytes equal")
        for r in rep["reads"]:
            state = "MATCH" if r["match"] else (f"MISMATCH ({r['bytes_differing']} bytes, "
                                                f"{r['words_differing']} words differ)")
            lines.append(f"  read {r['op']} ({r['buffer']}, {r['nbytes']} B): {state}")
    else:
        lines.append(f"trials: {rep['trials']}; stale in {rep['stale_fraction']:.3f} of trials "
                     f"(95 % {rep['stale_ci95'][0]:.3f}-{rep['stale_ci95'][1]:.3f}); simulator: "
                     f"{rep['simulated_stale_fraction'] if rep['simulated_stale_fraction'] is not None else 'n/a'} "
                     f"over {rep['simulator_seeds']} seeds")
        lines.append(f"implausible words: {rep['implausible_words']} "
                     f"({'every observed word is one the simulator deems possible' if rep['implausible_words'] == 0 else 'a bug in kvrace or in the kernel'})")
        for r in rep["reads"]:
            sim = (f"; simulator {r['simulated_stale_fraction']:.3f}" if "simulated_stale_fraction" in r else "")
            lines.append(f"  read {r['op']} ({r['buffer']}, {r['nbytes']} B): stale {r['stale_trials']}/"
                         f"{r['trials']} = {r['stale_fraction']:.3f} (95 % {r['stale_ci95'][0]:.3f}-"
                         f"{r['stale_ci95'][1]:.3f}){sim}; implausible words {r['implausible_words']}")
    if rep["first_mismatch"] is not None:
        lines.append("first mismatch: " + mismatch_text(rep["first_mismatch"]))
    if rep["oob_detected"]:
        for name, e in rep["oob_detected"].items():
            lines.append(f"  out of bounds on {name}: predicted {e['predicted_after_bytes']} B past the end "
                         f"({e['predicted_after_words']} words), guard caught {e['guard_after_words']} words; "
                         f"before the start predicted {e['predicted_before_bytes']} B, caught "
                         f"{e['guard_before_words']} words -> {'agree' if e['agree'] else 'DISAGREE'}")
    else:
        lines.append("  out of bounds: none predicted, guards intact")
    lines.append("OK" if rep["ok"] else "FAILED")
    return "\n".join(lines)


def cli_replay(args, *, make_runner=None) -> int:
    """``kvrace replay FILE --provider P --mode M [--trials N] [--profile X] [--seed S] [--json PATH|-]
    [--trace FILE]`` (``--trace``: the simulated and the measured timeline, ``replay_trace``).

    Exit 0 when every read agreed, 1 when one did not, 2 when the schedule cannot be replayed or an
    argument is bad (InputError, printed by kvrace.cli.main), 3 (in kvrace.cli) when there is no GPU."""
    from sim.report_io import check_output_path, emit
    from sim.schedule import load

    check_output_path(args.json, "--json")      # before the GPU work: a bad path is exit 2 now
    trace = getattr(args, "trace", None)
    if trace == "-":
        raise InputError("--trace", "expected a file path ('-' is not accepted: stdout carries the report)")
    check_output_path(trace, "--trace")
    s = load(args.file)
    try:
        rep = replay(s, args.provider, args.mode, profile=args.profile, trials=args.trials, seed=args.seed,
                     make_runner=make_runner, timeline=bool(trace))
    except ReplayError as e:
        print(f"kvrace: error: cannot replay {args.file} in controlled mode: {e}", file=sys.stderr)
        return 2
    except ProviderError as e:
        print(f"kvrace: error: {e}", file=sys.stderr)
        return 2
    if trace:
        from sim.report_io import write_json

        write_json(replay_trace(s, rep, profile=args.profile), trace)
    emit(rep, args.json, summary_text, default=_json_default)
    return 0 if rep["ok"] else 1


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
