"""Training steps captured in a CUDA graph (the trainers' ``--cuda-graph``): on a GPU a small model's step
is bound by the host launching its kernels one by one (the paper's VAE step: a few hundred launches,
most of its 3.9 ms on an H200), and a graph replays them all in one launch.

A step (forward, backward, optimizer step) of fixed shapes is captured once and replayed at every step
after: its inputs are copied into the captured ones, its outputs read from the captured ones. The
run stays the eager run:

- the warm-up steps that torch's recipe asks for before a capture (lazy library handles, the autograd
  engine's streams) are real training steps, run eagerly on a side stream;
- the random numbers are the eager run's: made outside the graph by the trainer's generator and copied
  in (vae), or drawn inside it from torch's generator of the device, which each replay advances as the
  eager step would, so that its saved state resumes the draws (mnist);
- the optimizer is made by :func:`capturable_adam`: its step counters live on the device and its learning
  rate is a device tensor that :func:`kivi_fast.experiments.training.set_lr` writes in place, so that
  the schedule's halvings reach the replayed step.

Nothing in kivi_fast's estimators reads a value back to the host on a GPU (python_tests/test_cuda.py
checks it under torch's sync debug mode), which is what lets a step that calls them be captured.
"""

from __future__ import annotations

from typing import Callable

import torch

Step = Callable[[dict], object]  # inputs -> the step's outputs: a tensor, or a dict of tensors


def capturable_adam(params, lr: float, device: torch.device) -> torch.optim.Adam:
    """Adam whose step a CUDA graph can capture: step counters on the device, the learning rate a tensor
    there (written in place by ``training.set_lr``)."""
    return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), capturable=True)


def trainer_adam(params, lr: float, device: torch.device, cuda_graph: bool) -> torch.optim.Adam:
    """The trainers' optimizer: :func:`capturable_adam` for ``--cuda-graph``, torch's default Adam else."""
    return capturable_adam(params, lr, device) if cuda_graph else torch.optim.Adam(params, lr=lr)


def trainer_step(step: Step, device: torch.device, cuda_graph: bool) -> Step:
    """The trainers' step: captured and replayed (:class:`CapturedStep`) for ``--cuda-graph``, else itself."""
    return CapturedStep(step, device) if cuda_graph else step


class CapturedStep:
    """``step(inputs)`` (a dict of tensors -> the step's outputs, a tensor or a dict of tensors; it runs
    the backward and the optimizer step) on ``device`` (a GPU) run eagerly for ``warmup`` calls, then
    captured in a CUDA graph and replayed.

    Every call must pass tensors of the same shapes, dtypes and devices under the same keys: they are
    copied into the captured inputs. The outputs of a replayed step are the graph's output tensors,
    overwritten by the next replay. Random numbers drawn inside the step from torch's generator of the
    device are drawn in the graph too: each replay advances that generator as the eager step would."""

    def __init__(self, step: Step, device: torch.device, warmup: int = 3):
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (an eager step before the capture), got {warmup}")
        self.step, self.warmup, self.done = step, warmup, 0
        # Streams and the capture belong to the step's GPU, which need not be the current one (cuda:1)
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs = None

    def __call__(self, inputs: dict[str, torch.Tensor]):
        with torch.cuda.device(self.device):
            if self.graph is None and self.done < self.warmup:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    outputs = self.step(inputs)
                torch.cuda.current_stream().wait_stream(self.side)
                self.done += 1
                return outputs
            if self.graph is None:
                self._capture(inputs)
            for key, value in inputs.items():
                self.inputs[key].copy_(value)
            self.graph.replay()
            return self.outputs

    def _capture(self, inputs: dict[str, torch.Tensor]) -> None:
        # The capture records the step without running it; the replay that follows runs this step.
        self.inputs = {key: value.clone() for key, value in inputs.items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(self.device)):
            self.outputs = self.step(self.inputs)
        self.graph = graph
