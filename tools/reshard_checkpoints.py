"""Reshard a mindzero checkpoint for another world size or stage (same as the `mindzero-reshard` command)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mindzero.checkpoint.cli import main_reshard  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_reshard())
