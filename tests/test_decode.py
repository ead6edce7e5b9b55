"""The decode side in simulated time (sim/engine/decode.py) and how the engine uses it."""
from __future__ import annotations

import pytest

from sim.engine.cost import CostModel
from sim.engine.decode import DecodeEngine, DecodeStepModel, TransferSize, transfer_size
from sim.engine.engine import PrefillEngine
from sim.engine.models import model
from sim.engine.scenario import load_scenario
from sim.errors import InputError
from sim.profile import load_profile


def steps(family="dsa-v3.2", tp=1, seed=0):
    fam = model(family)
    opts = {"index_k_dtype": "fp8", "index_k_store": "fallback", "indexer_path": "cuda"} if family == "dsa-v3.2" \
        else {"index_k_dtype": "bf16"}
    return DecodeStepModel(fam, CostModel.from_profile(load_profile("h200"), seed), opts, tp), fam, opts


def test_step_cost_grows_with_batch_and_context_and_shrinks_with_tp():
    m, _, _ = steps()
    one = m.nominal_us([1000])
    assert m.nominal_us([1000, 1000]) >= one
    assert m.nominal_us([100_000]) > one
    m8, _, _ = steps(tp=8)
    assert m8.nominal_us([1000]) < one
    # keyed jitter: a pure function of (seed, step)
    assert m.step_us([1000], 3) == m.step_us([1000], 3) != m.step_us([1000], 4)


def test_v4_step_model_prices_every_layer_kind():
    m, fam, opts = steps("deepseek-v4-flash")
    assert set(m.kinds) == {"swa", "c4", "c128"} and sum(m.kinds.values()) == fam.n_layers
    ts = transfer_size(fam, opts, 256)
    assert ts.per_token > 0 and ts.window_per_token == 584 * fam.n_layers and ts.window == 128


def test_requests_finish_after_their_output_tokens_and_join_at_step_boundaries():
    m, _, _ = steps()
    d = DecodeEngine(m, max_running=2, transfer_gbps=50.0, transfer=TransferSize(1000.0))
    assert d.transfer_us(50_000) == pytest.approx(1000.0)        # 50 MB at 50 GB/s
    d.admit(1, 0.0, 1000, 3)
    d.admit(2, 0.0, 1000, 1)
    d.admit(3, 0.0, 1000, 2)      # queued behind the cap of 2
    done = d.advance(1e12)
    order = [rid for rid, _ in done]
    # step 1 runs {1, 2} (2 finishes), request 3 joins at step 2's boundary, step 3 ends 1 and 3
    assert order == [2, 1, 3] and d.step_count == 3 and d.idle
    t = dict(done)
    assert 1000.0 < t[2] < t[1] == t[3]                        # after its transfer and one step
    # nothing runs before the transfer lands
    d2 = DecodeEngine(m, max_running=2, transfer_gbps=50.0, transfer=TransferSize(1000.0))
    d2.admit(7, 0.0, 50_000, 1)
    assert d2.advance(999.0) == [] and d2.next_event_us() == pytest.approx(1000.0)


def test_bad_decode_input_names_it():
    m, _, _ = steps()
    with pytest.raises(InputError, match="decode"):
        DecodeEngine(m, max_running=0, transfer_gbps=1.0, transfer=TransferSize(0.0))
    d = DecodeEngine(m, max_running=1, transfer_gbps=1.0, transfer=TransferSize(0.0))
    with pytest.raises(InputError, match="output_tokens"):
        d.admit(1, 0.0, 10, 0)


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_engine_completes_every_turn_after_its_decode(mode):
    sets = ["run.layers=2", "workload.sessions=3", "workload.concurrency=2"]
    if mode == "pd":
        sets += ["deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4", "hicache.decode=false"]
    e = PrefillEngine(load_scenario("glm5-22811-small", sets), 0)
    r = e.run()
    assert r.requests_completed == r.requests_total > 0
    assert e.decode.idle and e.decode.step_count > 0 and not e._decoding
    ops = e.session.finish().schedule.ops
    decode_ops = [op for op in ops if op.op == "compute" and op.id.startswith("decode")]
    # colocated: decode steps occupy the forward stream; PD: they run on the decode engine's GPUs
    assert (len(decode_ops) == e.decode.step_count) if mode == "colocated" else not decode_ops
    if mode == "pd":
        assert e.decode.transfer_bytes > 0


def test_pd_decode_hicache_is_refused_where_sglang_refuses_it():
    # SGLang 0.5.14 has no decode-side radix cache for hybrid SWA models (DeepSeek V4): the key
    # is an error there, never silently ignored
    with pytest.raises(InputError, match="hybrid SWA") as e:
        load_scenario("incident", ["hicache.decode=true"])
    assert e.value.where == "hicache.decode"
    assert not load_scenario("incident", ["hicache.decode=false"]).hicache.decode
    # dsa-v3.2 in PD: accepted, and the engine's decode side is the byte-level one
    pd = ["deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4", "run.layers=2"]
    sc = load_scenario("glm5-22811-small", pd)
    assert sc.hicache.decode
    from sim.engine.decode_hicache import DecodeCacheEngine
    assert isinstance(PrefillEngine(sc, 0).decode, DecodeCacheEngine)
    assert type(PrefillEngine(load_scenario("glm5-22811-small", pd + ["hicache.decode=false"]), 0).decode) \
        is DecodeEngine
    # colocated keeps both flags equal
    assert load_scenario("glm5-22811-small").hicache.decode
