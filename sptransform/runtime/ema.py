"""An fp32 exponential moving average of the parameters, kept in host memory.

``shadow <- decay * shadow + (1 - decay) * param`` after every optimizer step, as
DeepSeek-V3 does to keep the EMA out of GPU memory. Each rank averages its own
shard: a ``DTensor`` parameter contributes ``p.to_local()``.

On CUDA the parameters are copied, in their own dtype, into pinned host buffers
on a side stream (``non_blocking`` is only asynchronous into pinned memory), and a
worker thread blends them into the fp32 average once the copy lands, so neither
the GPU nor the training loop waits. Copying 16-bit values and upcasting on the
host moves half the bytes over PCIe that upcasting on the GPU would. Call
``before_optimizer_step()`` before the optimizer writes the parameters (it makes
the compute stream wait for the copies, without blocking the host), and
``synchronize()`` before reading the average; ``state_dict()`` and ``copy_to()``
synchronize themselves. On CPU the update is synchronous.

    ema = HostEMA(model, decay=0.999)
    for batch in data:
        loss = model(batch); loss.backward()
        ema.before_optimizer_step()
        optimizer.step(); optimizer.zero_grad()
        ema.update()
    ema.synchronize(); torch.save(ema.state_dict(), "ema.pt")
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


class HostEMA:
    """An fp32 EMA of (the local shards of) named parameters, in host memory."""

    def __init__(self, parameters: nn.Module | Iterable[tuple[str, torch.Tensor]], *, decay: float = 0.999):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} must be in [0, 1); 0.999 averages over about 1000 steps")
        named = parameters.named_parameters() if isinstance(parameters, nn.Module) else parameters
        self.decay = decay
        self.num_updates = 0
        self._params = dict(named)
        if not self._params:
            raise ValueError("HostEMA got no parameters; pass a module or its named_parameters()")
        pin = torch.cuda.is_available()
        with torch.no_grad():  # the average starts at the current values
            self._shadow = {name: self._host_buffer(_local(p), torch.float32, pin=pin).copy_(_local(p))
                            for name, p in self._params.items()}
        devices = {_local(p).device for p in self._params.values()}
        cuda_devices = [d for d in devices if d.type == "cuda"]
        self._device = cuda_devices[0] if cuda_devices else None
        if self._device is not None:
            self._stream = torch.cuda.Stream(device=self._device)
            self._staging = {name: self._host_buffer(_local(p), _local(p).dtype, pin=True)
                             for name, p in self._params.items()}
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-ema")
        self._copies_done: torch.cuda.Event | None = None
        self._blend: Future | None = None

    @staticmethod
    def _host_buffer(like: torch.Tensor, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pin)

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current parameter values into the average."""
        self.synchronize()  # the staging buffers and the average must be free before the next copy
        if self._device is None:
            for name, p in self._params.items():
                self._shadow[name].mul_(self.decay).add_(_local(p).detach(), alpha=1.0 - self.decay)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                for name, p in self._params.items():
                    self._staging[name].copy_(_local(p).detach(), non_blocking=True)
                self._copies_done = torch.cuda.Event()
                self._copies_done.record(self._stream)
            self._blend = self._worker.submit(self._blend_when_copied, self._copies_done)
        self.num_updates += 1

    def _blend_when_copied(self, copies_done: torch.cuda.Event) -> None:
        copies_done.synchronize()
        with torch.no_grad():
            for name, staged in self._staging.items():
                self._shadow[name].mul_(self.decay).add_(staged, alpha=1.0 - self.decay)

    def before_optimizer_step(self) -> None:
        """Make the current CUDA stream wait until the last update's copies have read the parameters."""
        if self._copies_done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._copies_done)

    def synchronize(self) -> None:
        """Wait for the last update to land in the average (re-raising any error it hit)."""
        if self._blend is not None:
            blend, self._blend = self._blend, None
            blend.result()

    def averaged(self) -> dict[str, torch.Tensor]:
        """The fp32 averages by parameter name (live host tensors)."""
        self.synchronize()
        return dict(self._shadow)

    @torch.no_grad()
    def copy_to(self, parameters: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the averages into parameters of the same names (e.g. an evaluation copy)."""
        self.synchronize()
        named = dict(parameters.named_parameters() if isinstance(parameters, nn.Module) else parameters)
        self._check_names(named.keys(), what="parameters")
        for name, p in named.items():
            _local(p).copy_(self._shadow[name])

    def state_dict(self) -> dict:
        self.synchronize()
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow": dict(self._shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.synchronize()
        shadow = state["shadow"]
        self._check_names(shadow.keys(), what="state_dict['shadow']")
        for name, value in shadow.items():
            if value.shape != self._shadow[name].shape:
                raise ValueError(
                    f"state_dict['shadow'][{name!r}] has shape {tuple(value.shape)} but this rank's shard is "
                    f"{tuple(self._shadow[name].shape)}; load the state saved by the same rank and layout"
                )
            self._shadow[name].copy_(value)
        self.decay = float(state["decay"])
        self.num_updates = int(state["num_updates"])

    def _check_names(self, names: Iterable[str], *, what: str) -> None:
        names = set(names)
        missing, unexpected = sorted(set(self._shadow) - names), sorted(names - set(self._shadow))
        if missing or unexpected:
            raise ValueError(
                f"{what} does not match the averaged parameters: missing {missing}, unexpected {unexpected}; "
                "pass the same named parameters the EMA was built from"
            )
