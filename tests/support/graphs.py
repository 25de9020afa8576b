"""The graphs MindSpore compiled, as text: :func:`saved_graphs` saves the IR of the passes named for what runs
inside it, and :func:`last_graph` reads the last one saved."""
import contextlib
import os
import re
from pathlib import Path

import mindspore as ms


@contextlib.contextmanager
def saved_graphs(directory, passes: str):
    """Inside: every compile saves the IR of the passes ``passes`` names (``MS_DEV_DUMP_IR_PASSES``: e.g.
    ``"type_inference"``, ``"execute"``; one pass instead of every pass's: a compile takes half the time) into
    ``directory``; after: saving off and the environment as it was. A process saves the passes it named first:
    MindSpore reads the variable once (seen: ``"validate"`` after ``"type_inference"`` in one process saved
    nothing), so the tests of one process name the same pass."""
    before = os.environ.get("MS_DEV_DUMP_IR_PASSES")
    try:
        os.environ["MS_DEV_DUMP_IR_PASSES"] = passes
        ms.set_context(save_graphs=1, save_graphs_path=str(directory))
        yield
    finally:
        ms.set_context(save_graphs=0)
        if before is None:
            os.environ.pop("MS_DEV_DUMP_IR_PASSES", None)
        else:
            os.environ["MS_DEV_DUMP_IR_PASSES"] = before


def last_graph(directory, pass_name: str) -> str:
    """The text of the last IR file of ``pass_name`` saved under ``directory`` (files are numbered in the order
    MindSpore writes them)."""
    paths = list(Path(directory).rglob(f"*{pass_name}*.ir"))
    if not paths:
        raise FileNotFoundError(f"no IR file of pass {pass_name!r} under {directory}")
    return max(paths, key=lambda p: int(re.findall(r"_(\d+)\.ir$", p.name)[0])).read_text()


def comparable(text: str) -> str:
    """An IR file's text without what differs between two compiles of the same graph in one process: the compile
    phase's name, the numbers MindSpore gives graphs, nodes and recompute regions as it makes them, the debug
    names of nodes (made of the source's variable names, in no fixed order), addresses, and the comment lines
    (source locations)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith(("compile_phase", "#"))]
    text = re.sub(r'unique_id: "\d+"|recompute_id: I64\(\d+\)|0x[0-9a-f]+', "", "\n".join(lines))
    text = re.sub(r"(%\d+)\([^)]*\)", r"\1", text)
    return re.sub(r"\b\d+_", "N_", re.sub(r"_\d+", "_N", text))
