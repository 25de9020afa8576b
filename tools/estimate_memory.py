"""Per-rank memory of ZeRO stages 0-3 before step 1 (same as the `mindzero-estimate` command)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mindzero.core.estimate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
