"""The benchmarks' own checks (`make bench-check`): the research modules in benchmarks/simlab import as `simlab`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
