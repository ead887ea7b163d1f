"""Write DIR/sweep_report.md and DIR/report/*.png comparing the jobs of a sweep.

    python scripts/sweep_report.py runs/multirun/2026-12-02/16-40-00

`python launch.py -m ...` writes the same report when its last job ends.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.report import write_report  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python scripts/sweep_report.py SWEEP_DIR")
    print(write_report(Path(sys.argv[1])))
