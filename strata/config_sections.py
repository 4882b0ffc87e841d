"""The configuration's sections, one dataclass each, mirroring `config.toml`: every key's default and the checks
of its value, a `ConfigError` naming the key. Every section but `[debug]` (`DebugConfig`: switches for debugging and
measuring strata) is a user setting."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.config_values import check_auto_or_bool, parse_size, size_field
from strata.errors import ConfigError

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DEVICE_NAMES = ("auto", "cpu", "cuda")
EVICTION_POLICIES = ("static", "lru", "lfu", "cost")
BUDGET_SCOPES = ("global", "per_layer")


@dataclass
class RuntimeConfig:
    """[runtime]: where and how the model runs."""

    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (CUDA: bf16; CPU: a bf16 checkpoint's bf16, else fp32), "float32", "bfloat16", "float16"
    # tokens per sequence (prompt + generated), capped by the model's own limit; "auto": that limit, as far as the
    # KV cache fits a quarter of the memory left after the weights (strata.runtime.plan.context)
    max_context: int | str = field(default="auto", metadata={"auto_or_int": True})
    # prompt tokens per forward pass during prefill: "auto" (CUDA: as many as planner.activation_reserve holds, up
    # to 8192; CPU: 512; strata.runtime.generation.prefill_chunk) or a number
    prefill_chunk: int | str = field(default="auto", metadata={"auto_or_int": True})
    threads: int = 0  # torch CPU threads; 0 = torch's default (one per physical core)
    experts: str = "tiered"  # "tiered": served by the tier manager from a store; "memory": all loaded up front
    cpu_numerics: str = "fork"  # "fork": fast CPU expert kernels; "gpu": cold experts copied to the GPU
    prefill_keeps_resident: bool = False  # true: a prompt's cold experts stream through step-copy slots
    decode_gap_target: float = 0.5  # seconds a serving step may take while sequences decode; 0: no pacing
    prefill_chunk_min: int = 32  # prompt tokens a serving step carries at least while sequences decode
    # `strata serve`: decode every batch size once before turning ready (strata.runtime.generation.warmup); "auto" on CUDA
    warmup: bool | str = field(default="auto", metadata={"auto_or_bool": True})
    devices: list[int] = field(default_factory=list)  # CUDA indices the layers are split over; [] = `device` alone
    # later prompts start from the KV rows of earlier and running ones that share their prefix
    # (strata.runtime.generation.prefix_cache); prefix_cache_slots: KV slots beside planner.max_batch's that only
    # keep prefixes (each max_context tokens, counted by the planner)
    prefix_cache: bool = True
    prefix_cache_slots: int = 0

    def __post_init__(self) -> None:
        gap = self.decode_gap_target
        if isinstance(gap, bool) or not isinstance(gap, int | float) or not 0 <= gap <= 3600:
            raise ConfigError(f"runtime.decode_gap_target = {gap!r} is invalid; give seconds in [0, 3600] (0 turns pacing off)")
        if self.cpu_numerics not in ("fork", "gpu"):
            raise ConfigError(f"runtime.cpu_numerics = {self.cpu_numerics!r} is invalid; use \"fork\" or \"gpu\"")
        if not isinstance(self.prefill_keeps_resident, bool):
            raise ConfigError(f"runtime.prefill_keeps_resident = {self.prefill_keeps_resident!r} is invalid; "
                              "use true or false")
        check_auto_or_bool("runtime.warmup", self.warmup)
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"runtime.prefix_cache = {self.prefix_cache!r} is invalid; use true or false")
        if self.experts not in ("tiered", "memory"):
            raise ConfigError(f"runtime.experts = {self.experts!r} is invalid; use \"tiered\" or \"memory\"")
        if self.device not in DEVICE_NAMES and not (self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ConfigError(f"runtime.device = {self.device!r} is invalid; use one of {', '.join(DEVICE_NAMES)} or cuda:N")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"runtime.dtype = {self.dtype!r} is invalid; use one of {', '.join(DTYPE_NAMES)}")
        chunk = self.prefill_chunk
        if chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ConfigError(f"runtime.prefill_chunk = {chunk!r} is invalid; use \"auto\" or a number of tokens >= 1")
        ctx = self.max_context
        if ctx != "auto" and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 16):
            raise ConfigError(f"runtime.max_context = {ctx!r} is invalid; use \"auto\" or a number of tokens >= 16")
        for key, low in (("threads", 0), ("prefill_chunk_min", 1), ("prefix_cache_slots", 0)):
            value = getattr(self, key)
            if value < low:
                raise ConfigError(f"runtime.{key} = {value} is out of range; it must be >= {low}")
        self._check_devices()

    def _check_devices(self) -> None:
        """`devices` is a list of distinct CUDA indices; with it, `device` names its first card (or is auto/cuda)."""
        d = self.devices
        if not isinstance(d, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in d):
            raise ConfigError(f"runtime.devices = {d!r} is invalid; use a list of CUDA device indices, e.g. [0, 1]")
        if len(set(d)) != len(d):
            raise ConfigError(f"runtime.devices = {d!r} names a device twice; list each GPU once")
        if d and self.device not in ("auto", "cuda", f"cuda:{d[0]}"):
            raise ConfigError(f"runtime.device = {self.device!r} conflicts with runtime.devices = {d!r}; set "
                              f'runtime.device = "auto" (or "cuda:{d[0]}") or drop runtime.devices')

    @property
    def prefix_only_slots(self) -> int:
        """KV slots the prefix cache adds beside planner.max_batch's (0 when it is off)."""
        return self.prefix_cache_slots if self.prefix_cache else 0

    @property
    def primary_device(self) -> str:
        """The card the engine runs on: the first of `devices` (inputs, sampling), else `device`."""
        return f"cuda:{self.devices[0]}" if self.devices else self.device


@dataclass
class GpuTierConfig:
    """[tiers.gpu]: expert slots in VRAM."""

    budget: str | int = size_field("auto")  # bytes for expert slots per GPU; "auto": what the planner leaves

    def __post_init__(self) -> None:
        parse_size(self.budget, "tiers.gpu.budget")

    @property
    def budget_bytes(self) -> int | None:
        """The budget in bytes, None for "auto"."""
        return parse_size(self.budget, "tiers.gpu.budget")


@dataclass
class PinnedTierConfig:
    """[tiers.pinned]: page-locked host RAM for experts (plain RAM on CPU-only hosts)."""

    budget: str | int = size_field("auto")  # "auto": RAM available minus a safety margin

    def __post_init__(self) -> None:
        parse_size(self.budget, "tiers.pinned.budget")

    @property
    def budget_bytes(self) -> int | None:
        """The budget in bytes, None for "auto"."""
        return parse_size(self.budget, "tiers.pinned.budget")


@dataclass
class TmpfsTierConfig:
    """[tiers.tmpfs]: a copy of part of the store in a RAM-backed filesystem that survives restarts."""

    path: str = "/dev/shm/strata"
    budget: str | int = size_field("0")  # tmpfs is RAM: opt in with an explicit size, never "auto"

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError('tiers.tmpfs.path is empty; give a directory, e.g. "/dev/shm/strata"')
        parse_size(self.budget, "tiers.tmpfs.budget", allow_auto=False)

    @property
    def budget_bytes(self) -> int:
        """The budget in bytes."""
        return parse_size(self.budget, "tiers.tmpfs.budget", allow_auto=False) or 0


@dataclass
class DiskTierConfig:
    """[tiers.disk]: where expert stores live (each holds every expert of a model)."""

    path: str = "~/.cache/strata"
    scrub: bool = True  # re-verify every blob's checksum once in the background, at the lowest priority
    reader: str = "auto"  # disk -> GPU: "auto" (kvikio when GPUDirect Storage is present), "kvikio", "posix"

    def __post_init__(self) -> None:
        if self.reader not in ("auto", "kvikio", "posix"):
            raise ConfigError(f'tiers.disk.reader = {self.reader!r} is invalid; use "auto", "kvikio" or "posix"')
        if not isinstance(self.scrub, bool):
            raise ConfigError(f"tiers.disk.scrub must be true or false, got {self.scrub!r}")
        if not self.path:
            raise ConfigError('tiers.disk.path is empty; give a directory, e.g. "~/.cache/strata"')


@dataclass
class TiersConfig:
    """[tiers.*]: the memory tiers experts live in, fastest first."""

    gpu: GpuTierConfig = field(default_factory=GpuTierConfig)
    pinned: PinnedTierConfig = field(default_factory=PinnedTierConfig)
    tmpfs: TmpfsTierConfig = field(default_factory=TmpfsTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)


@dataclass
class PolicyConfig:
    """[policy]: which experts a full tier gives up."""

    eviction: str = "lfu"  # static | lru | lfu | cost
    lfu_half_life: int = 8192  # lookups (all layers) after which an LFU count counts half
    budget_scope: str = "global"  # global | per_layer
    promote: bool = True  # split decode: copy a CPU-computed expert that became popular into the GPU tier (background)

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"policy.eviction = {self.eviction!r} is invalid; use one of {', '.join(EVICTION_POLICIES)}")
        if self.budget_scope not in BUDGET_SCOPES:
            raise ConfigError(f"policy.budget_scope = {self.budget_scope!r} is invalid; use one of {', '.join(BUDGET_SCOPES)}")
        if self.lfu_half_life < 1:
            raise ConfigError(f"policy.lfu_half_life = {self.lfu_half_life} is out of range; it must be >= 1")


@dataclass
class PrefetchConfig:
    """[prefetch]: loading experts before the router asks for them."""

    lookahead: int = 1  # layers ahead predicted from the router; 0 disables

    def __post_init__(self) -> None:
        if self.lookahead < 0:
            raise ConfigError(f"prefetch.lookahead = {self.lookahead} is out of range; it must be >= 0")


@dataclass
class PlannerConfig:
    """[planner]: what the planner keeps aside before placing experts."""

    activation_reserve: str | int = size_field("2GiB")  # VRAM kept free for activations and the allocator
    max_batch: int = 1  # sequences the KV cache is sized for

    def __post_init__(self) -> None:
        parse_size(self.activation_reserve, "planner.activation_reserve", allow_auto=False)
        if self.max_batch < 1:
            raise ConfigError(f"planner.max_batch = {self.max_batch} is out of range; it must be >= 1")

    @property
    def activation_reserve_bytes(self) -> int:
        """The reserve in bytes."""
        return parse_size(self.activation_reserve, "planner.activation_reserve", allow_auto=False) or 0


@dataclass
class EngramTierConfig:
    """[engram]: where Engram lookup tables live and how much RAM their hot rows get."""

    tier: str = "auto"  # where the full tables live: "auto" | "gpu" | "pinned" | "tmpfs" | "disk"
    row_cache: str | int = size_field("auto")  # hot-row cache; "auto": 1/8 of the tables, at most 1 GiB

    def __post_init__(self) -> None:
        if self.tier not in ("auto", "gpu", "pinned", "tmpfs", "disk"):
            raise ConfigError(f'engram.tier = {self.tier!r} is invalid; use "auto", "gpu", "pinned", "tmpfs" or "disk"')
        parse_size(self.row_cache, "engram.row_cache")

    @property
    def row_cache_bytes(self) -> int | None:
        """The row cache in bytes, None for "auto"."""
        return parse_size(self.row_cache, "engram.row_cache")


STORE_EXPERTS = ("checkpoint", "fp8", "mxfp4")
STORE_MODES = ("auto", "in_place", "packed")


@dataclass
class StoreConfig:
    """[store]: how a checkpoint is packed into a store (`strata convert`, and the store built on first use)."""

    # routed experts as the checkpoint ships them ("checkpoint": bf16, block-scaled FP8 or MXFP4), or a bf16
    # checkpoint's quantized while packing: "fp8" (128 x 128 blocks, or the largest of 64/32/16 dividing the
    # intermediate size) or "mxfp4"
    experts: str = "checkpoint"
    # where the experts are read from: "in_place" (the checkpoint's own safetensors files, through an index in the
    # cache: no second copy on disk), "packed" (a store built in the cache, `strata convert`), or "auto" (in place
    # when the checkpoint's files are on a local disk and can be read as they are; `strata plan` says which and why)
    mode: str = "auto"
    reverify: bool = False  # in place: a source file that changed is checksummed again instead of refused

    def __post_init__(self) -> None:
        if self.experts not in STORE_EXPERTS:
            raise ConfigError(f"store.experts = {self.experts!r} is invalid; use one of {', '.join(STORE_EXPERTS)}")
        if self.mode not in STORE_MODES:
            raise ConfigError(f"store.mode = {self.mode!r} is invalid; use one of {', '.join(STORE_MODES)}")
        if not isinstance(self.reverify, bool):
            raise ConfigError(f"store.reverify must be true or false, got {self.reverify!r}")


CPU_KERNELS = ("auto", "avx512_bf16", "avx512", "avx2", "torch")


@dataclass
class DebugConfig:
    """[debug]: switches for debugging strata and measuring what each of its paths is worth. Their defaults are the
    fast, tested paths; users leave them alone.

    Every key is read per engine, when it is built or runs (two engines of one process may differ), with two
    process-wide effects: `cpu_threads` sizes the CPU kernel's one thread pool (engines asking different counts
    rebuild it when they alternate), and `fused_kernels` / `pdl` hold while the engine's model runs a forward pass
    (`strata.kernels.options`), so kernels launched outside one (none in strata's own decode step) see the defaults."""

    cuda_graphs: bool = True  # decode steps captured and replayed as CUDA graphs; false: always eager
    split_decode: str = "graph"  # cold experts of a one-graph step on the native CPU worker; "host": host steps
    warm_ahead: bool = True  # the CPU worker reads the next layer's predicted cold experts into its caches early
    overlap_decode: bool | str = field(default="auto", metadata={"auto_or_bool": True})  # queue step t+1 early
    grouped_prefill: bool | str = field(default="auto", metadata={"auto_or_bool": True})  # prefill's grouped GEMMs
    engram_prefetch: bool = True  # Engram rows fetched as soon as a step's token ids exist
    engram_read_batch: int = 4096  # Engram rows per background read job
    engram_zero_copy: bool = True  # pinned / tmpfs Engram tables read in place by the GPU
    engram_graph_wait: bool = True  # disk Engram rows served to one CUDA graph a step through a handshake
    # one-graph split decode: the share of cold rows the GPU reads in place, "auto" (balanced on its waits) or a
    # fixed fraction in [0, 1] (`GpuShare.MAX` at most taken; 0: none, and then no warm-ahead either)
    gpu_share: float | str = field(default="auto", metadata={"auto_or_number": True})
    cpu_threads: int = 0  # the CPU kernel pool's threads (experts; a CPU decode's dense projections); 0: from the cores
    cpu_kernel: str = "auto"  # the CPU expert kernel's instruction set, or "torch" (the reference math)
    fused_kernels: bool = True  # the decode step's fused kernels (Triton; the CPU's compiled rows); false: torch's chains
    pdl: bool = True  # programmatic dependent launch of the decode kernels (Hopper and later)

    def __post_init__(self) -> None:
        for key in ("cuda_graphs", "warm_ahead", "engram_prefetch", "engram_zero_copy", "engram_graph_wait",
                    "fused_kernels", "pdl"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"debug.{key} = {getattr(self, key)!r} is invalid; use true or false")
        for key in ("overlap_decode", "grouped_prefill"):
            check_auto_or_bool(f"debug.{key}", getattr(self, key))
        if self.split_decode not in ("graph", "host"):
            raise ConfigError(f'debug.split_decode = {self.split_decode!r} is invalid; use "graph" or "host"')
        share = self.gpu_share
        if share != "auto" and (isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1):
            raise ConfigError(f'debug.gpu_share = {share!r} is invalid; use "auto" or a fraction in [0, 1]')
        if self.cpu_kernel not in CPU_KERNELS:
            raise ConfigError(f"debug.cpu_kernel = {self.cpu_kernel!r} is invalid; use one of {', '.join(CPU_KERNELS)}")
        for key, low in (("engram_read_batch", 1), ("cpu_threads", 0)):
            if getattr(self, key) < low:
                raise ConfigError(f"debug.{key} = {getattr(self, key)} is out of range; it must be >= {low}")

    @property
    def fixed_gpu_share(self) -> float | None:
        """`gpu_share` as a number, None for "auto" (balanced on the GPU's waits)."""
        return None if self.gpu_share == "auto" else float(self.gpu_share)
