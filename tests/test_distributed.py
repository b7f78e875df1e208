"""Data-parallel training under mpiexec: two ranks end where one process ends; a failing rank
stops every rank."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from test_training import batches, bn_dropout_model, mlp

from onnx_autodiff.demo import write_example
from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.training import Trainer, generate_artifacts
from onnx_autodiff.training import distributed

pytest.importorskip("mpi4py", reason="the [mpi] extra is not installed")
MPIEXEC = shutil.which("mpiexec") or pytest.skip("no mpiexec on PATH", allow_module_level=True)
TIMEOUT = 120  # seconds: a hang fails the test instead of stalling the suite


def mpiexec(ranks: int, *command, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([MPIEXEC, "-n", str(ranks), *map(str, command)], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=cwd)


def global_batches(count=3):
    """Batches of 6, 6 and 5 examples: the last one splits 3 + 2 between two ranks."""
    data = list(batches(count))
    X, y = data[-1]
    data[-1] = (X[:-1], y[:-1])
    return data


WORKER = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_distributed import global_batches
from onnx_autodiff.training import Trainer, TrainingArtifacts
from onnx_autodiff.training import distributed

comm = distributed.world()
trainer = Trainer(TrainingArtifacts.load(sys.argv[1]), comm=comm)
losses = []
for X, y in global_batches():
    mine = np.array_split(np.arange(len(X)), comm.Get_size())[comm.Get_rank()]
    losses.append(trainer.step((X[mine], y[mine])))
np.savez(f"{{sys.argv[2]}}.{{comm.Get_rank()}}.npz", losses=np.array(losses), **trainer.state_dict())
"""


def run_ranks(tmp_path, artifacts, ranks=2) -> list[dict]:
    """Trains ``artifacts`` on the global batches in ``ranks`` processes; every rank's state."""
    artifacts.save(tmp_path / "artifacts")
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=os.path.dirname(__file__)))
    done = mpiexec(ranks, sys.executable, script, tmp_path / "artifacts", tmp_path / "state")
    assert done.returncode == 0, done.stderr
    return [dict(np.load(tmp_path / f"state.{r}.npz")) for r in range(ranks)]


@pytest.mark.parametrize("optimizer, lora", [("adamw", None), ("sgd", None), ("adamw", LoraConfig(rank=2))])
def test_two_ranks_end_where_one_process_ends(tmp_path, optimizer, lora):
    options = {"lr": 0.05, "momentum": 0.9} if optimizer == "sgd" else {"lr": 0.01}
    artifacts = generate_artifacts(mlp(), optimizer=optimizer, optimizer_options=options, gradient_accumulation=True,
                                   lora=lora)
    if lora is not None:  # only the adapters are parameters: only their gradients travel
        assert all(".lora_" in name for name in artifacts.params)
    states = run_ranks(tmp_path, artifacts)
    alone = Trainer(artifacts)
    losses = [alone.step(batch) for batch in global_batches()]
    for state in states:  # both ranks hold the same parameters: the one-process ones
        for name in artifacts.params:
            np.testing.assert_allclose(state[name], alone.parameters()[name], rtol=1e-5, atol=1e-7)
        assert int(state["__step__"]) == 3
        # each rank reports the loss of the whole batch (the ranks' losses weighted by their shares)
        np.testing.assert_allclose(state["losses"], losses, rtol=1e-5)


def test_batchnorm_statistics_are_averaged_over_the_ranks(tmp_path):
    model = bn_dropout_model()
    dropout = next(n for n in model.graph.node if n.op_type == "Dropout")
    dropout.op_type, dropout.input[:] = "Identity", dropout.input[:1]
    artifacts = generate_artifacts(model, optimizer="sgd", optimizer_options={"lr": 0.0}, gradient_accumulation=True)
    states = run_ranks(tmp_path, artifacts)
    np.testing.assert_array_equal(states[0]["mean"], states[1]["mean"])
    # lr 0: the running mean moves towards each batch's mean; averaged over equal or weighted
    # slices it is the whole batch's, as one process computes it
    alone = Trainer(artifacts)
    for batch in global_batches():
        alone.step(batch)
    np.testing.assert_allclose(states[0]["mean"], alone.state_dict()["mean"], rtol=1e-5, atol=1e-7)


def test_train_command_on_two_ranks_equals_one_process(tmp_path):
    write_example(tmp_path / "example")
    common = ["train", tmp_path / "example" / "model.onnx", "--data", tmp_path / "example" / "train.npz",
              "--val-data", tmp_path / "example" / "val.npz", "--epochs", 2, "--batch-size", 64, "--lr", 0.01]
    alone = subprocess.run([sys.executable, "-m", "onnx_autodiff", *map(str, common), "-o", tmp_path / "one"],
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert alone.returncode == 0, alone.stderr
    ranks = mpiexec(2, sys.executable, "-m", "onnx_autodiff", *common, "-o", tmp_path / "two")
    assert ranks.returncode == 0, ranks.stderr
    assert ranks.stdout.count("epoch 1/2") == 1 and "on 2 ranks" in ranks.stdout  # rank 0 alone prints
    one, two = (onnx.load(tmp_path / run / "model.onnx") for run in ("one", "two"))
    for a, b in zip(one.graph.initializer, two.graph.initializer):
        np.testing.assert_allclose(numpy_helper.to_array(b), numpy_helper.to_array(a), rtol=1e-5, atol=1e-6)
    rows = [list(csv.DictReader(open(tmp_path / run / "metrics.csv"))) for run in ("one", "two")]
    for a, b in zip(*rows):
        for key in ("loss", "val_loss", "val_accuracy"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5)


def test_a_batch_size_the_ranks_cannot_share_is_refused(tmp_path):
    write_example(tmp_path / "example")
    done = mpiexec(2, sys.executable, "-m", "onnx_autodiff", "train", tmp_path / "example" / "model.onnx",
                   "--data", tmp_path / "example" / "train.npz", "--batch-size", 63, "-o", tmp_path / "run")
    assert done.returncode != 0
    assert "--batch-size 63 is the global batch: it must divide among the 2 ranks" in done.stderr


FAILING = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_distributed import global_batches
from onnx_autodiff.training import Trainer, TrainingArtifacts
from onnx_autodiff.training import distributed

comm = distributed.world()
with distributed.abort_on_error(comm):
    trainer = Trainer(TrainingArtifacts.load(sys.argv[1]), comm=comm)
    for step, (X, y) in enumerate(global_batches()):
        if {fail!r} == "raise" and step == 1 and comm.Get_rank() == 1:
            raise RuntimeError("the data loader of rank 1 broke")
        if {fail!r} == "nan" and step == 1 and comm.Get_rank() == 1:
            X = X.copy(); X[-1, 0] = np.nan  # in rank 1's slice
        mine = np.array_split(np.arange(len(X)), comm.Get_size())[comm.Get_rank()]
        trainer.step((X[mine], y[mine]))
"""


@pytest.mark.parametrize("fail, message", [
    ("raise", "error on rank 1 of 2: the data loader of rank 1 broke"),
    ("nan", "step 2: not finite on rank 1 of 2"),
])
def test_a_failing_rank_stops_every_rank(tmp_path, fail, message):
    generate_artifacts(mlp(), optimizer="adamw", gradient_accumulation=True).save(tmp_path / "artifacts")
    script = tmp_path / "failing.py"
    script.write_text(FAILING.format(tests=os.path.dirname(__file__), fail=fail))
    done = mpiexec(2, sys.executable, script, tmp_path / "artifacts")  # a hang would time out
    assert done.returncode != 0
    assert message in done.stderr


def test_a_process_started_alone_trains_alone(monkeypatch):
    from mpi4py import MPI

    for name in distributed._LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert distributed.world() is None  # not started by mpiexec: MPI is not even imported
    artifacts = generate_artifacts(mlp(), optimizer="adamw")  # no accumulate model: one rank needs none
    alone, self_only = Trainer(artifacts), Trainer(artifacts, comm=MPI.COMM_SELF)
    assert self_only.comm is None
    for batch in batches(2):
        assert alone.step(batch) == self_only.step(batch)
    with pytest.raises(Exception, match="gradient_accumulation=True"):
        Trainer(artifacts, comm=FakeWorld())


class FakeWorld:
    """A communicator of two ranks, as far as the Trainer's constructor looks."""

    def Get_size(self):
        return 2
