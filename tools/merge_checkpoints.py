"""Merge a mindzero checkpoint directory into one full checkpoint (same as the `mindzero-merge` command)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mindzero.checkpoint.cli import main_merge  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_merge())
