"""The planner's pure rules for a factory defined in the running training script: what at the script's top level
runs code when a rehearsal imports it (refused before any rehearsal, naming the line and the remedies), and the
environment a rehearsal process gets (none of the launch's cluster variables). No MindSpore."""
import pytest

from mindzero.planner.factory import check_importable_script, top_level_code
from mindzero.planner.rehearse import rehearsal_env

GUARDED = '''"""A training script whose work is under the guard."""
import argparse
import mindspore as ms
from mindspore import nn

WIDTH = 64
SIZES = (WIDTH, 2 * WIDTH, -1)
DTYPE = ms.float32


def factory():
    net = nn.Dense(WIDTH, WIDTH)
    return net, nn.Adam(net.trainable_params())


class Loss(nn.Cell):
    pass


if __name__ == "__main__":
    args = argparse.ArgumentParser().parse_args()
    ms.communication.init()
'''

UNGUARDED = '''import argparse
import mindspore as ms

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int)
args = parser.parse_args()
ms.communication.init()


def factory():
    pass


main()
'''


def test_a_guarded_script_runs_nothing_at_import():
    assert top_level_code(GUARDED) == []


def test_every_statement_that_runs_code_is_found_with_its_line():
    assert top_level_code(UNGUARDED) == [(4, "parser = argparse.ArgumentParser()"),
                                         (5, 'parser.add_argument("--steps", type=int)'),
                                         (6, "args = parser.parse_args()"), (7, "ms.communication.init()"),
                                         (14, "main()")]
    assert top_level_code("x = f()\n") == [(1, "x = f()")]
    assert top_level_code("for i in range(3):\n    pass\n") == [(1, "for i in range(3):")]
    assert top_level_code("if __name__ == '__main__':\n    main()\nelif True:\n    pass\n") == []
    assert top_level_code("if DEBUG:\n    main()\n") == [(1, "if DEBUG:")]


def test_the_refusal_names_the_script_the_line_and_the_remedies(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED)
    with pytest.raises(ValueError) as err:
        check_importable_script(str(script), "factory")
    msg = str(err.value)
    assert f"factory=factory: defined in the script {script}, which runs code at its top level (line 4: " in msg
    assert "'parser = argparse.ArgumentParser()' (and 4 more)" in msg
    assert "Define the factory in a module the script imports" in msg and 'if __name__ == "__main__":' in msg
    guarded = tmp_path / "guarded.py"
    guarded.write_text(GUARDED)
    check_importable_script(str(guarded), "factory")  # no error


def test_a_rehearsal_sees_none_of_the_launchs_cluster_variables():
    env = {"PATH": "/bin", "HOME": "/root", "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_NODE_ID": "1",
           "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118", "RANK_ID": "1", "RANK_SIZE": "2",
           "OMPI_COMM_WORLD_RANK": "1", "PMI_RANK": "1", "PMIX_NAMESPACE": "x", "SLURM_PROCID": "1",
           "MS_DEV_RUNTIME_CONF": "memory_statistics:True", "GLOG_v": "2", "MINDZERO_DEVICE": "CPU"}
    assert rehearsal_env(env) == {"PATH": "/bin", "HOME": "/root", "MS_DEV_RUNTIME_CONF": "memory_statistics:True",
                                  "GLOG_v": "2", "MINDZERO_DEVICE": "CPU"}
