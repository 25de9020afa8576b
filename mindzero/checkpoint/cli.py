"""The command lines of the offline checkpoint tools (console scripts ``mindzero-merge``,
``mindzero-reshard``, ``mindzero-verify``; no MindSpore import)."""
from __future__ import annotations

import argparse
import sys

from .format import FORMATS
from .offline import PARAMETER_VALUES, merge_checkpoint, reshard_checkpoint, verify_checkpoint
from .source import MergeError


def _cli(prog: str, description: str):
    """The parser every offline tool starts from (``CKPT_DIR -o OUT [--force]``)."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("ckpt_dir")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return ap


def _run(prog: str, action) -> int:
    """Run ``action``; a :class:`MergeError` becomes one line on stderr and exit status 2."""
    try:
        action()
    except MergeError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


def main_merge(argv=None):
    """``mindzero-merge CKPT_DIR -o OUT [--format ckpt|safetensors] [--with-optimizer] [--force]
    [--parameter-values master|param]``"""
    ap = _cli("mindzero-merge", "Merge a mindzero checkpoint into one full checkpoint (original parameter "
              "names), streaming tensor by tensor.")
    ap.add_argument("--format", choices=FORMATS, default="ckpt")
    ap.add_argument("--with-optimizer", action="store_true", help="include optimizer states and scalars")
    ap.add_argument("--parameter-values", choices=PARAMETER_VALUES, default="master",
                    help="a param_dtype run's parameters: its fp32 masters (default) or the param_dtype copies")
    a = ap.parse_args(argv)
    return _run("mindzero-merge", lambda: merge_checkpoint(a.ckpt_dir, a.out, a.format, a.with_optimizer, a.force,
                                                           parameter_values=a.parameter_values))


def main_reshard(argv=None):
    """``mindzero-reshard CKPT_DIR -o OUT --world-size M [--stage S] [--format F] [--force]``"""
    ap = _cli("mindzero-reshard", "Rewrite a mindzero checkpoint for another world size and/or ZeRO stage, "
              "optimizer state included.")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--stage", type=int, choices=(0, 1, 2, 3))
    ap.add_argument("--format", choices=FORMATS)
    a = ap.parse_args(argv)
    return _run("mindzero-reshard", lambda: reshard_checkpoint(a.ckpt_dir, a.out, a.world_size, a.stage, a.format,
                                                               a.force))


def main_verify(argv=None):
    """``mindzero-verify CKPT_DIR [CKPT_DIR ...]``: exit status 0 if every checkpoint is whole, 1 otherwise."""
    ap = argparse.ArgumentParser(prog="mindzero-verify", description="Verify mindzero checkpoints: marker, split "
                                 "infos, every tensor's checksum, cross-rank consistency.")
    ap.add_argument("ckpt_dir", nargs="+")
    a = ap.parse_args(argv)
    return 0 if all([verify_checkpoint(d)["ok"] for d in a.ckpt_dir]) else 1
