"""``python -m gpu_backend.calibrate --refit PROFILE.toml --out NEW.toml [--link-provider sglang]``."""
import sys

from gpu_backend.calibrate.cli import main

sys.exit(main())
