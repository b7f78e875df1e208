"""Data-parallel throughput: the GPT L=1 benchmark model trained on 1 and on 2 MPI ranks (one
intra-op thread each), and an estimate for N machines.

    python benchmarks/data_parallel.py [--steps 30] [--batch 16] [--ranks 1 2]

Needs the ``mpi`` extra (``pip install ".[mpi]"``: mpi4py, MPICH's mpiexec). Each configuration
runs in its own ``mpiexec -n K`` job: every rank takes its slice of the same global batches
(``--batch`` examples a step) and ``Trainer(..., comm=MPI.COMM_WORLD)`` sums the gradients with
Allreduce. Prints examples per second, the speed-up, the gradient bytes each step moves and the
measured Allreduce time, then the time a ring Allreduce of those bytes would add per step on a few
networks, beside the compute time of one machine's share of the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models

NETWORKS = [("1 GbE", 0.125e9, 50e-6), ("10 GbE", 1.25e9, 20e-6), ("100 Gb InfiniBand", 12.5e9, 2e-6)]


def worker(args) -> None:
    """One rank: ``args.steps`` steps on its slices of the global batches; rank 0 prints JSON."""
    import onnxruntime as ort

    from onnx_autodiff.training import Trainer, distributed

    comm = distributed.world()
    rank, ranks = distributed.rank(comm), distributed.size(comm)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    options.enable_mem_pattern = False
    trainer = Trainer(args.worker, session_options=options, comm=comm)
    config = models.GPTConfig(layers=1, batch=args.batch)
    data = [models.inputs_of(config, seed=s) for s in range(4)]
    slices = [{k: v[np.array_split(np.arange(args.batch), ranks)[rank]] for k, v in d.items()} for d in data]
    for batch in slices[:2]:  # warm-up
        trainer.step(batch)
    if comm is not None:
        comm.Barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        trainer.step(slices[step % len(slices)])
    seconds = time.perf_counter() - start
    gradients = [trainer.state.value(key).numpy() for key in trainer.manifest.params]
    reduce_ms = 0.0
    if comm is not None:  # the Allreduce alone, as each step does it
        comm.Barrier()
        begin = time.perf_counter()
        for _ in range(10):
            distributed.sum_in_place(comm, [g.copy() for g in gradients])
        reduce_ms = (time.perf_counter() - begin) / 10 * 1e3
    if rank == 0:
        print(json.dumps({"ranks": ranks, "step_ms": seconds / args.steps * 1e3, "examples_per_s": args.batch * args.steps / seconds,
                          "gradient_bytes": int(sum(g.nbytes for g in gradients)), "allreduce_ms": reduce_ms}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="global batch (examples per step)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # an artifacts directory: run as one rank
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print('mpiexec not found: pip install ".[mpi]"', file=sys.stderr)
        return 1
    from onnx_autodiff.training import generate_artifacts

    config = models.GPTConfig(layers=1, batch=args.batch)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for ranks in args.ranks:  # the model's batch axis is static: each rank's share of the batch
            artifacts = os.path.join(folder, f"artifacts{ranks}")
            local = models.helper_model(models.GPTConfig(layers=1, batch=args.batch // ranks))
            generate_artifacts(local, loss=None, optimizer="adamw", gradient_accumulation=True).save(artifacts)
            command = [mpiexec, "-n", str(ranks), sys.executable, __file__, "--worker", artifacts,
                       "--steps", str(args.steps), "--batch", str(args.batch)]
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = rows[0]["examples_per_s"]
    megabytes = rows[0]["gradient_bytes"] / 1e6
    print(f"GPT L=1 (d_model {config.d_model}, vocabulary {config.vocab}, sequence {config.seq}), AdamW, global batch "
          f"{args.batch}, {args.steps} steps, 1 intra-op thread per rank, {os.cpu_count()} cores; gradients "
          f"{megabytes:.2f} MB per step\n")
    print("| ranks | ms per step | examples/s | speed-up | Allreduce of the gradients, ms |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['ranks']} | {row['step_ms']:.1f} | {row['examples_per_s']:.0f} | "
              f"{row['examples_per_s'] / base:.2f} | {row['allreduce_ms']:.2f} |")
    compute = rows[0]["step_ms"] / 1e3  # one rank's step on the whole batch
    print("\nEstimate for N machines, each running one rank on batch/N examples: a ring Allreduce sends "
          "2(N-1)/N of the gradient bytes over each link, plus 2(N-1) message latencies:\n")
    print("| network | N | compute ms | Allreduce ms | step ms | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, bandwidth, latency in NETWORKS:
        for n in (2, 4, 8, 16):
            reduce = 2 * (n - 1) / n * rows[0]["gradient_bytes"] / bandwidth + 2 * (n - 1) * latency
            step = compute / n + reduce
            print(f"| {name} | {n} | {compute / n * 1e3:.1f} | {reduce * 1e3:.2f} | {step * 1e3:.1f} | {compute / step:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
