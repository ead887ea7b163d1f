"""hsdp-grpo: compose a config with Hydra, validate it, start the torchrun workers.

python launch.py parallel=hsdp_r2s2 device=cpu        # 4 ranks: 2 replica groups x 2-way shards
python launch.py parallel=hsdp_r2s4 model=qwen3_4b dry_run=true   # the plan, nothing started
python launch.py --help                               # config groups and their presets
"""

import sys

import hydra
from omegaconf import DictConfig

from launcher import overrides, sweep
from launcher.main import run
from launcher.schema import register
from launcher.validate import ConfigError

register()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> int:
    return run(cfg)


if __name__ == "__main__":
    try:
        overrides.check(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
    sys.exit(sweep.finish())
