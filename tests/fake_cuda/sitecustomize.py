"""A CUDA machine faked on a CPU-only one, for the rehearsal of the scripts' CUDA path (tests/test_cuda_rehearsal.py,
bench/gpu.sh --dry_run). Python imports this file at start-up in every process whose PYTHONPATH holds its folder
(torchrun's ranks included; there it takes the place of any other sitecustomize), and FAKE_CUDA=1 turns it on;
CUDA_VISIBLE_DEVICES= (empty) hides the GPUs, as it does on a GPU machine.

Only the device layer is faked: torch.cuda's answers (available, how many, the name, bf16 support, the current GPU),
where tensors live (asked for on a GPU, they live on the CPU), pinned memory, NCCL (gloo runs instead), DDP's
device_ids, and CUDA autocast (the CPU's runs instead, so that bf16 and fp16 really compute). Each fake first does the
checks a GPU machine does: torch.cuda.set_device keeps its own argument check (only the C call under it is faked), a
device is parsed by torch.device and its index must be a GPU this machine has, and NCCL's device_id and DDP's
device_ids must be the GPU the process made current. torch.cuda.max_memory_allocated is torch's own: with no CUDA
allocator it says 0.

Settings: FAKE_CUDA_NAME (torch.cuda.get_device_name's answer, default NVIDIA H100 80GB HBM3), FAKE_CUDA_COUNT (GPUs,
default 2), FAKE_CUDA_BF16=0 (a GPU without bf16 units, such as a V100 or T4), FAKE_CUDA_MEMORY_MIB (GPU memory: a
tensor larger than this is CUDA's out-of-memory error), FAKE_CUDA_TRACE (a file that gets a line for each kind of
CUDA-only call a process makes, so that a test can see which branches ran)."""

import os
import time
from types import SimpleNamespace


def install():
    import torch
    import torch.distributed as dist
    from torch.cuda._utils import _get_device_index
    from torch.nn.parallel import DistributedDataParallel
    from torch.overrides import TorchFunctionMode

    name = os.environ.get("FAKE_CUDA_NAME", "NVIDIA H100 80GB HBM3")
    count = int(os.environ.get("FAKE_CUDA_COUNT", 2))
    has_bf16 = os.environ.get("FAKE_CUDA_BF16", "1") == "1"
    total_memory = int(float(os.environ.get("FAKE_CUDA_MEMORY_MIB", 80 * 1024)) * 2**20)
    state = dict(current=0, memory_cap=total_memory)  # the current GPU's index; the memory this process may use
    traced = set()

    def trace(event):
        if os.environ.get("FAKE_CUDA_TRACE") and event not in traced:
            traced.add(event)
            with open(os.environ["FAKE_CUDA_TRACE"], "a") as f:
                f.write(f"rank {os.environ.get('RANK', 0)}: {event}\n")

    def index_of(device=None):
        """A GPU's index, by torch's own parsing and checks (no index: the current GPU); one this machine must have."""
        index = _get_device_index(device, optional=True)
        if not 0 <= index < count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return index

    def is_cuda(device):
        return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"

    def on_the_cpu(device):
        """A GPU, checked, becomes the CPU; any other device stays as it is."""
        if not is_cuda(device):
            return device
        index_of(device)
        return torch.device("cpu")

    # torch.cuda's answers; torch.cuda.set_device keeps its own argument check, and only the call under it is faked
    def set_device(index):
        state["current"] = index_of(index)
        trace(f"set_device {index}")

    def get_device_name(device=None):
        index_of(device)
        return name

    torch._C._cuda_setDevice = set_device
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: count
    torch.cuda.current_device = lambda: state["current"]
    torch.cuda.get_device_name = get_device_name
    torch.cuda.is_bf16_supported = lambda including_emulation=True: has_bf16 or including_emulation

    # the tensors are on the CPU, and so are their random numbers: CUDA's generator state is the CPU's (torch.compile
    # saves and restores it around a compilation)
    def get_rng_state(device="cuda"):
        index_of(device)
        return torch.get_rng_state()

    def set_rng_state(new_state, device="cuda"):
        index_of(device)
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state, torch.cuda.set_rng_state = get_rng_state, set_rng_state

    # what bench/ and torch.compile ask of a GPU besides: its properties, a memory cap, synchronizing, resetting the
    # peak memory
    def get_device_properties(device=None):
        index_of(device)
        # gcnArchName: torch.compile's cache key reads it on a torch without CUDA, such as this CPU one
        return SimpleNamespace(name=name, gcnArchName=name, total_memory=total_memory, major=9 if has_bf16 else 7,
                               minor=0)

    def set_per_process_memory_fraction(fraction, device=None):
        index_of(device)
        state["memory_cap"] = int(fraction * total_memory)

    torch.cuda.get_device_properties = get_device_properties
    torch.cuda.set_per_process_memory_fraction = set_per_process_memory_fraction
    torch.cuda.synchronize = torch.cuda.reset_peak_memory_stats = index_of

    # a CUDA event stamps the host's clock (on a CPU ops run as called); read before it is recorded, it fails as
    # CUDA's does
    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            self.seconds = None

        def record(self, stream=None):
            trace("Event.record")
            self.seconds = time.perf_counter()

        def elapsed_time(self, end):
            if self.seconds is None or end.seconds is None:
                raise RuntimeError("CUDA error: device not ready (an event not recorded)")
            return (end.seconds - self.seconds) * 1000

    torch.cuda.Event = Event

    # a CUDA generator is a CPU one
    class Generator(torch.Generator):
        def __new__(cls, device="cpu"):
            if is_cuda(device):
                trace(f"Generator {device}")
            return super().__new__(cls, on_the_cpu(device))

        def __init__(self, device="cpu"):
            pass

    torch.Generator = Generator

    # CUDA autocast is the CPU's: bf16 and fp16 really compute
    class autocast(torch.amp.autocast_mode.autocast):
        def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            if device_type == "cuda":
                trace(f"autocast cuda {dtype}")
                device_type = "cpu"
            super().__init__(device_type, dtype, enabled, cache_enabled)

    torch.autocast = autocast

    # TF32 matmuls: the call is seen, and it changes nothing that matters on a CPU
    set_float32_matmul_precision = torch.set_float32_matmul_precision

    def set_precision(precision):
        trace(f"float32_matmul_precision {precision}")
        set_float32_matmul_precision(precision)

    torch.set_float32_matmul_precision = set_precision

    # NCCL is gloo; its device must be the GPU this process made current
    init_process_group = dist.init_process_group

    def init_nccl_as_gloo(backend=None, *args, device_id=None, **kwargs):
        if backend == "nccl":
            if not is_cuda(device_id) or index_of(device_id) != state["current"]:
                raise ValueError(f"NCCL's device_id {device_id} is not the current GPU, cuda:{state['current']}")
            trace(f"init_process_group nccl {device_id}")
            backend, device_id = "gloo", None
        return init_process_group(backend, *args, device_id=device_id, **kwargs)

    dist.init_process_group = init_nccl_as_gloo

    # DDP's device_ids: the current GPU alone, as on a GPU machine; the module is on the CPU, where DDP takes none
    ddp_init = DistributedDataParallel.__init__

    def ddp_on_the_current_gpu(self, module, device_ids=None, *args, **kwargs):
        if device_ids is not None:
            if [index_of(d) for d in device_ids] != [state["current"]]:
                raise ValueError(f"DDP's device_ids {device_ids} are not [the current GPU], [{state['current']}]")
            trace(f"DDP device_ids {device_ids}")
        ddp_init(self, module, None, *args, **kwargs)

    DistributedDataParallel.__init__ = ddp_on_the_current_gpu

    class TensorsOnTheCPU(TorchFunctionMode):
        """Every torch function called from Python: a GPU given as its device, or to Tensor.to, is the CPU; pinning
        keeps the tensor; and a tensor larger than the GPU's memory is
        CUDA's out-of-memory error."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            # torch.compile traces through this mode: there the call goes as it is (the traced tensors are on the
            # CPU already), so that the graph holds the model's calls alone
            if torch.compiler.is_compiling():
                return func(*args, **kwargs)
            if func is torch.Tensor.pin_memory:
                trace("pin_memory")
                return args[0]
            if "device" in kwargs:
                kwargs["device"] = on_the_cpu(kwargs["device"])
            if func is torch.Tensor.to:
                args = [args[0], *map(on_the_cpu, args[1:])]
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.nbytes > state["memory_cap"]:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {out.nbytes / 2**20:.2f} MiB. "
                                             f"GPU {state['current']} has a total capacity of "
                                             f"{total_memory / 2**30:.2f} GiB")
            return out

    TensorsOnTheCPU().__enter__()


if os.environ.get("FAKE_CUDA") == "1" and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    install()
