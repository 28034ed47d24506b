"""The GPU work the sections measure: a matmul load that holds the power limit, and MLP steps.

The matmul load draws a steady, known power for the energy comparisons and the
whole trial; the MLP's training step is what runs out of memory in the ``oom``
section and what ``probe_model`` sizes in the ``probe`` section.
"""

from __future__ import annotations

import gc
import time

import torch


def free_cuda() -> None:
    """Drop what the last piece of work left on the GPU, so the next starts from free memory."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


class MatmulLoad:
    """Back-to-back bf16 matrix products, synchronised every ``chunk`` products."""

    def __init__(self, n: int = 8192, chunk: int = 20) -> None:
        self.n = n
        self.chunk = chunk
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        self.rate_per_s = 100.0
        """Products per second, as last measured by :meth:`run`."""

    def run(self, seconds: float) -> float:
        """Run for about ``seconds``; returns the achieved TFLOP/s."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        products = 0
        while time.perf_counter() - start < seconds:
            for _ in range(self.chunk):
                torch.matmul(self.a, self.b, out=self.out)
            torch.cuda.synchronize()
            products += self.chunk
        elapsed = time.perf_counter() - start
        self.rate_per_s = products / elapsed
        return 2.0 * self.n**3 * products / elapsed / 1e12

    def baseline_tflops(self) -> float:
        """TFLOP/s with no monitor or heartbeat running, after a warm-up (clocks, cuBLAS).

        The reference against which the monitors' and heartbeats' cost on the
        load is read.
        """
        self.run(3.0)
        return self.run(5.0)

    def release(self) -> None:
        del self.a, self.b, self.out


class MlpTask:
    """An MLP classifier (``width`` inputs, 10 classes) and its Adam optimizer; random batches."""

    classes = 10

    def __init__(self, width: int, depth: int) -> None:
        self.width = width
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(width, self.classes))
        self.model = torch.nn.Sequential(*layers).cuda()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def make_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.randn(batch_size, self.width, device="cuda"),
            torch.randint(0, self.classes, (batch_size,), device="cuda"),
        )

    def step(self, batch_size: int) -> None:
        """One training step on a fresh random batch, waited for (so an OOM raises here)."""
        x, y = self.make_batch(batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        torch.cuda.synchronize()
