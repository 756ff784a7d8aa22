"""Optimizer state in bfloat16 (`optimizer.state_dtype=bf16`): half the bytes of Adam's moments and
Muon's momentum, kept on track by stochastic rounding.

[Note: bf16 optimizer state and its rounding]
The state is kept in bfloat16 between steps; each step reads it into float32, updates it there
with the float32 gradient, computes the parameter update from those float32 values, and writes the
state back to bfloat16 with *stochastic* rounding: a value between two bf16 neighbours becomes the
upper one with probability equal to its distance from the lower one (in units of the gap), so
the stored state is unbiased. Round-to-nearest is not: an exponential average's step
(1 - beta) (x - v) smaller than half a bf16 gap (2^-9 to 2^-8 of v) is lost every time. With
beta2 = 0.999 that is any |x - v| under 1.95 v or more: the second moment can never decrease
(x >= 0) and grows only on a squared gradient above ~3 v; tests/unit/test_optim_state_dtype.py shows such an
average stuck where float32's moves, and this rounding following it. With our defaults (beta1 0.9,
beta2 0.95, Muon's momentum 0.95) nearest rounding loses steps under 2-8% of the value, a bias
that grows as gradients change slowly; stochastic rounding is used for every write, at every
beta, because it keeps all of them unbiased. Kahan-style compensation would track as well, but
it keeps a second bf16 tensor per state, which is the saving given back; stochastic rounding
costs no bytes.

Its random bits are not drawn from a generator: they are a hash of (the job's seed, the
parameter's step count, the tensor's slot in the optimizer, which state it is, and the float32
value's own 32 bits). So a rounding depends on nothing a rank owns: the same element rounds the
same way whichever rank holds it, at any world size or shard-boundary policy, and a resumed job
(whose state and step counts come from the checkpoint) repeats the run it continues bit for bit.
Over steps the hash's input changes with the step count, so the decisions for a fixed value are
independent draws, which is what makes the rounding unbiased. The price of reading the value's
bits: two runs whose values differ in the last fp32 bit (another world size sums gradients in
another order) draw other roundings for them, so such runs part by whole bf16 gaps in a few
elements (measured in tests/integration/test_state_dtype.py: under 1e-4 in the loss after 10 steps).
The hash runs on the float's bits viewed as int32, in place: xor, product and sum are the same
bits on signed as on unsigned 32-bit integers, and each right shift is masked (torch's copies the
sign), so it equals its first, int64 form bit for bit (tests/unit/test_optim_state_dtype.py
keeps that form as the reference). The key is made from the step count where the count lives
(a float32 tensor on the parameter's device, as torch's capturable AdamW keeps it): splitmix64 in
int64 tensor arithmetic, which wraps as the unsigned form does; no step reads a value on the host.

[Note: the bf16-state AdamW step on tensor lists]
`AdamWLowState.step` does what torch's foreach AdamW does, each operation once over a list of
tensors (`torch._foreach_*`: one C++ loop, or one launch per list on a GPU, instead of a Python
call per parameter), in chunks of at most CHUNK_CPU / CHUNK_ACCELERATOR elements: a parameter
larger than that is cut into views of its flattened elements (the update and the rounding are
elementwise, and the key is the tensor's, so a cut changes no bit), small ones are packed
together. Per chunk: both moments are read into one float32 buffer, updated there with torch's
AdamW operations in torch's order (the bias corrections and step sizes are made in float64 from
the count tensor, as torch makes them in Python floats, and cast to float32 as its kernels cast
those: the same bits, tests/unit/test_optim_state_dtype.py, against torch's AdamW with float32
state; with bf16 state the square root is the correctly rounded one, `_sqrt`, which on a CPU
torch's is not), the parameters updated from them, then the whole buffer rounded by one run of the int32
hash (each tensor's key xor-ed into its span first) and written back as bfloat16. The chunk
bounds the step's scratch (four buffers of twice its size) and, on a CPU, keeps them in cache
between the dozen operations of the rounding: on 2.6M parameters (bench/results/lowp_step.txt,
a loaded 2-core machine, CPU time) 2^17-element chunks took 42 ms a step where 2^21 took 81 ms
(torch's foreach AdamW with float32 state: 19.5 ms; this step before the lists: 227 ms). On a CPU the
update is addcdiv with the step sizes as a CPU tensor (its C++ reads them); elsewhere the same
order (step size x m, / denom, + p) in three list operations, which read nothing on the host.
These torch operations are the step on a GPU (and on a CPU without a C compiler). On a CPU with
one, bf16 state is stepped by one compiled loop instead, the same bits in one pass over memory:
[Note: the bf16-state AdamW step in one pass on a CPU] in lowp_cpu.py (0.3x torch's foreach
AdamW's time where these operations take 3x: bench/RESULTS.md).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from framework.optim import lowp_cpu

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None

STATE_DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}

# The step's chunks ([Note: the bf16-state AdamW step on tensor lists]): on a CPU, small enough that
# a chunk's float32 and int32 buffers stay in its caches between the operations; on an
# accelerator, large enough that the launches per chunk are few.
CHUNK_CPU = 1 << 17
CHUNK_ACCELERATOR = 1 << 24

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # the multiplier of a well-mixing 32-bit integer hash (two rounds)
_HIGH16 = -65536  # 0xFFFF0000 as an int32: the bits a bfloat16 keeps
_SPLITMIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _splitmix64(x: int) -> int:
    x = (x + _SPLITMIX[0]) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * _SPLITMIX[1]) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * _SPLITMIX[2]) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _signed(x: int, bits: int) -> int:
    """The two's-complement value of the low `bits` bits of `x` (how a tensor of that width holds them)."""
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >> (bits - 1) else x


def _shr(x: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """`x >> n` as on unsigned integers of `bits` bits (torch's `>>` on its signed tensors copies the sign)."""
    return (x >> n) & ((1 << (bits - n)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """`_splitmix64` on an int64 tensor: the same 64 bits (int64 sums and products wrap as unsigned ones do)."""
    x = x + _signed(_SPLITMIX[0], 64)
    x = (x ^ _shr(x, 30, 64)) * _signed(_SPLITMIX[1], 64)
    x = (x ^ _shr(x, 27, 64)) * _signed(_SPLITMIX[2], 64)
    return x ^ _shr(x, 31, 64)


def rounding_key(seed: int, step, slot, salt):
    """The 32-bit key of one tensor's rounding at one step: [Note: bf16 optimizer state and its rounding].
    With Python ints, an int in [0, 2^32). With `step` a tensor (the optimizer's float32 count, on the
    parameter's device; `slot` and `salt` ints or int64 tensors that broadcast with it): an int32
    tensor there, each element the same 32 bits as the int form, made without reading the count on
    the host."""
    if not isinstance(step, torch.Tensor):
        x = 0
        for part in (seed, step, slot, salt):
            x = _splitmix64(x ^ (part & 0xFFFFFFFFFFFFFFFF))
        return x & _MASK32
    return _finish_key(_key_prefix(seed, step, slot) ^ salt)


def _key_prefix(seed: int, step: torch.Tensor, slot) -> torch.Tensor:
    """`rounding_key`'s hash of (seed, step, slot) on the step's device, int64; the salt goes last."""
    x = _splitmix64_tensor(step.to(torch.int64) ^ _signed(_splitmix64(seed & 0xFFFFFFFFFFFFFFFF), 64))
    return _splitmix64_tensor(x ^ slot)


def _finish_key(x: torch.Tensor) -> torch.Tensor:
    """The last round of `rounding_key` (its input already xor-ed with the salt), as int32 keys."""
    return _wrap32(_splitmix64_tensor(x) & _MASK32).to(torch.int32)


def _wrap32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as the int32 values with the same bits (in int64)."""
    return x - ((x >> 31) << 32)


def _int32_key(key):
    """A key (a 32-bit int, or an int32 tensor from `rounding_key`) as an int32 operand."""
    return key if isinstance(key, torch.Tensor) else _signed(key, 32)


def _round_bits_(out: torch.Tensor, bits: torch.Tensor, tmp: torch.Tensor, *, keyed: bool = False, key=0) -> None:
    """`out` (int32) := the bits of the float32 values whose bits are `bits` (int32), stochastically
    rounded to bfloat16's precision, the low 16 bits zero; `tmp` is int32 scratch of the same shape.
    The noise is a hash of (key, the value's 32 bits): with `keyed`, `out` already holds
    bits ^ key (several tensors' keys at once). All in int32, in place: the unsigned hash's sums,
    products and xors are the same bits on int32, its right shifts are masked (torch's copy the sign).
    NaNs are the caller's: adding noise to their bits may make them infinities or numbers."""
    if not keyed:
        torch.bitwise_xor(bits, key, out=out)
    for _ in range(2):
        torch.bitwise_right_shift(out, 16, out=tmp)
        tmp.bitwise_and_(0xFFFF)
        out.bitwise_xor_(tmp).mul_(_MIX)
    torch.bitwise_right_shift(out, 16, out=tmp)  # only its low 16 bits count below: no mask
    out.bitwise_xor_(tmp).bitwise_and_(0xFFFF)  # the noise: 16 bits
    # adding up to one bf16 gap to the magnitude bits and cutting the low 16 bits rounds the
    # magnitude up with probability (low 16 bits) / 2^16; a finite value's sum never reaches the
    # sign bit (the largest rounds up to infinity), and an infinity's low bits are zero: it stays
    out.add_(bits).bitwise_and_(_HIGH16)


def _keep_nan_(rounded: torch.Tensor, x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """`rounded` (x rounded by `_round_bits_`), NaN where `x` is NaN: max(r, min(r, x)) is r where x
    is a number (min(r, x) <= r; signed zeros and infinities included) and NaN where x is NaN
    (both propagate it): two vectorized operations, no mask."""
    return torch.maximum(rounded, torch.minimum(rounded, x, out=tmp), out=rounded)


def stochastic_round_bf16(x: torch.Tensor, key) -> torch.Tensor:
    """`x` (float32) rounded to bfloat16 stochastically, with bits hashed from `key` (an int, or an
    int32 tensor from `rounding_key`) and each value's own bits (deterministic; [Note: bf16
    optimizer state and its rounding]). Infinities stay as they are, NaNs stay NaN. On a CPU with
    the compiled loop ([Note: the bf16-state AdamW step in one pass on a CPU]) in one pass, the
    same bits."""
    x = x.to(torch.float32).contiguous()
    key = _int32_key(key)
    if x.device.type == "cpu" and (not isinstance(key, torch.Tensor) or key.device.type == "cpu"):
        lib = cpu_library()
        if lib is not None:
            return lowp_cpu.round_bf16(lib, x, key)
    return _torch_round(x, key)


def _torch_round(x: torch.Tensor, key) -> torch.Tensor:
    """`stochastic_round_bf16` in torch operations (any device): `x` contiguous float32, `key` an
    int32 value or 0-d int32 tensor."""
    out = torch.empty_like(x, dtype=torch.int32)
    _round_bits_(out, x.view(torch.int32), torch.empty_like(out), key=key)
    rounded = _keep_nan_(out.view(torch.float32), x, torch.empty_like(x))
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero


def store_(state: torch.Tensor, value: torch.Tensor, key: int) -> None:
    """Write float32 `value` into the state tensor `state`: a plain copy when the state is float32,
    stochastically rounded when it is bfloat16."""
    if state.dtype == torch.float32:
        state.copy_(value)
    else:
        state.copy_(stochastic_round_bf16(value, key))


def recast_state_(optimizer: torch.optim.Optimizer, keys, dtype: torch.dtype) -> None:
    """Put the named state tensors back in `dtype` after `load_state_dict` (torch's casts every
    floating state to its parameter's dtype; bf16 state held as float32 converts back exactly)."""
    for st in optimizer.state.values():
        for k in keys:
            v = st.get(k)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype:
                st[k] = v.to(dtype)


# salts: which state a rounding is for
SALT_EXP_AVG, SALT_EXP_AVG_SQ, SALT_MOMENTUM = 1, 2, 3


class AdamWLowState(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments: torch.optim.AdamW's update) with its
    moments `exp_avg` / `exp_avg_sq` held in `state_dtype` (bfloat16) and `step` a float32 scalar
    tensor on the parameter's device (as torch's capturable AdamW keeps it); [Note: bf16 optimizer
    state and its rounding]. Steps whole tensors, our engine's pieces and DTensors' local tensors
    alike (every operation is elementwise), over tensor lists: [Note: the bf16-state AdamW step on
    tensor lists]; bf16 state on a CPU in one compiled loop where it can be built (`cpu_kernel`,
    [Note: the bf16-state AdamW step in one pass on a CPU]), the same bits."""

    # Every operation is elementwise and takes no norm: our engine may step it on the plain local
    # data ([Note: the optimizer step on plain local data] in framework/distributed/fsdp/optim_check.py).
    elementwise_step = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        cpu_kernel: bool = True,
    ) -> None:
        # torch's AdamW's settings, so that the param groups (which a resume compares with the
        # checkpoint's) have the same keys with either state dtype; amsgrad, maximize and the
        # fused/foreach/capturable forms stay off (the builder sets none of them)
        like = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, like.defaults)
        self.state_dtype = state_dtype
        self.seed = seed
        # bf16 state on a CPU: step in the compiled loop where it is available and checked ([Note:
        # the bf16-state AdamW step in one pass on a CPU]); False: always the torch operations
        self.cpu_kernel = cpu_kernel

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        recast_state_(self, ("exp_avg", "exp_avg_sq"), self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter with a gradient: [Note: the bf16-state AdamW step on
        tensor lists]."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        low_on_cpu = self.state_dtype == torch.bfloat16 and any(
            p.grad is not None and p.device.type == "cpu" for group in self.param_groups for p in group["params"]
        )
        self._step(cpu_library() if self.cpu_kernel and low_on_cpu else None)
        return loss

    def _step(self, lib) -> None:
        """The step, with the compiled CPU loop `lib` (for the parameters it `fits`) or None."""
        slot = -1
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise NotImplementedError("AdamWLowState: amsgrad and maximize are not implemented")
            todo: Dict[torch.device, List] = {}
            for p in group["params"]:
                slot += 1  # the parameter's place in the groups: the same on every rank
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # the count on the parameter's device, as torch's capturable AdamW keeps it
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, dtype=self.state_dtype, memory_format=torch.preserve_format
                    )
                elif state["step"].device != p.device:  # a count loaded where torch's load left it
                    state["step"] = state["step"].to(p.device)
                todo.setdefault(p.device, []).append((p, state, slot))
            for items in todo.values():
                self._step_tensors(group, items, lib)

    def _step_tensors(self, group: dict, items: List, lib=None) -> None:
        """The step of `items` ((param, state, slot), all on one device): [Note: the bf16-state
        AdamW step on tensor lists]; with `lib`, those it `fits` in the compiled CPU loop ([Note:
        the bf16-state AdamW step in one pass on a CPU])."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        device = items[0][0].device
        steps = [st["step"] for _, st, _ in items]
        torch._foreach_add_(steps, 1.0)
        count = torch.stack(steps).to(torch.float64)
        # torch's AdamW makes these with Python floats, which its float32 kernels cast to float32:
        # the same float64 operations here (pow, subtraction, true division, sqrt), then the cast
        step_size = torch.full_like(count, lr).div_(torch.pow(b1, count).neg_().add_(1)).neg_().float()
        bc2_sqrt_all = torch.pow(b2, count).neg_().add_(1).sqrt_().float()
        bc2_sqrt = bc2_sqrt_all.unbind()
        step_sizes = step_size.unbind() if device.type != "cpu" else None
        low = self.state_dtype != torch.float32
        if low:  # each tensor's two rounding keys, 0-d int32 tensors
            keys = self._keys(device, count, [s for _, _, s in items])
            mom_keys, sq_keys = keys[0].unbind(), keys[1].unbind()
        tensors = [_local_tensors(p, st) for p, st, _ in items]
        if low and lib is not None and device.type == "cpu":
            fit = [i for i, four in enumerate(tensors) if lowp_cpu.fits(*four)]
            if fit:
                idx = None if len(fit) == len(tensors) else torch.tensor(fit)
                pick = (lambda t: t.contiguous()) if idx is None else (lambda t: t[idx].contiguous())  # noqa: E731
                lowp_cpu.adamw_step(
                    lib,
                    [tensors[i] for i in fit],
                    pick(keys[0]),
                    pick(keys[1]),
                    pick(step_size),
                    pick(bc2_sqrt_all),
                    lr=lr,
                    betas=(b1, b2),
                    eps=eps,
                    weight_decay=wd,
                )
                rest = set(range(len(tensors))) - set(fit)
                tensors = [t if i in rest else None for i, t in enumerate(tensors)]
            if not any(t is not None for t in tensors):
                return
        sizes, chunks = _chunks(tensors, _chunk_elements(device))
        # one chunk's float32 moments ([exp_avg of each tensor, exp_avg_sq of each tensor]), and int32 scratch
        buf = torch.empty(2 * max(sizes), dtype=torch.float32, device=device)
        hashed, scratch = torch.empty_like(buf, dtype=torch.int32), torch.empty_like(buf, dtype=torch.int32)
        for size, chunk in zip(sizes, chunks):
            params, grads, moms, sqs = ([_cut(tensors[i][k], span) for i, span in chunk] for k in range(4))
            m32, v32 = buf[:size], buf[size : 2 * size]
            exp_avgs, exp_avg_sqs = _views(m32, moms), _views(v32, sqs)
            torch._foreach_copy_(exp_avgs + exp_avg_sqs, moms + sqs)
            # torch's AdamW, operation for operation (tests/unit/test_optim_state_dtype.py)
            torch._foreach_lerp_(exp_avgs, grads, 1 - b1)
            v32.mul_(b2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - b2)
            denom_flat = _sqrt(v32, scratch[:size].view(torch.float32), exact=low)
            denom = _views(denom_flat, sqs)
            torch._foreach_div_(denom, [bc2_sqrt[i] for i, _ in chunk])
            denom_flat.add_(eps)
            if lr * wd != 0:
                torch._foreach_mul_(params, 1 - lr * wd)
            if device.type == "cpu":  # p + (step_size * m) / denom, in one pass: addcdiv's order
                torch._foreach_addcdiv_(params, exp_avgs, denom, step_size[[i for i, _ in chunk]])
            else:  # the same order, without reading the step sizes on the host as addcdiv's list would
                update = torch._foreach_mul(exp_avgs, [step_sizes[i] for i, _ in chunk])
                torch._foreach_div_(update, denom)
                torch._foreach_add_(params, update)
                del update
            if not low:  # float32 state: stored as it is
                torch._foreach_copy_(moms + sqs, exp_avgs + exp_avg_sqs)
                continue
            bits, out, tmp = buf[: 2 * size].view(torch.int32), hashed[: 2 * size], scratch[: 2 * size]
            offset = 0
            for (i, _), t in zip(chunk, moms):  # bits ^ key, each tensor's keys
                n = t.numel()
                for lo, key in ((offset, mom_keys[i]), (size + offset, sq_keys[i])):
                    torch.bitwise_xor(bits[lo : lo + n], key, out=out[lo : lo + n])
                offset += n
            _round_bits_(out, bits, tmp, keyed=True)
            rounded = _keep_nan_(out.view(torch.float32), buf[: 2 * size], tmp.view(torch.float32))
            torch._foreach_copy_(moms + sqs, _views(rounded[:size], moms) + _views(rounded[size:], sqs))

    def _keys(self, device: torch.device, count: torch.Tensor, slots: List[int]) -> torch.Tensor:
        """[2, len(slots)] int32: each tensor's rounding keys of exp_avg and exp_avg_sq at its count."""
        cached = getattr(self, "_slots_cache", None)
        if cached is None or cached[0] != (device, slots):  # a host-to-device copy only when they change
            cached = ((device, slots), torch.tensor(slots, dtype=torch.int64, device=device))
            self._slots_cache = cached
        prefix = _key_prefix(self.seed, count, cached[1])
        return _finish_key(torch.stack([prefix ^ SALT_EXP_AVG, prefix ^ SALT_EXP_AVG_SQ]))


def _sqrt(x: torch.Tensor, out: torch.Tensor, *, exact: bool) -> torch.Tensor:
    """sqrt(x) into `out`, float32. With `exact`, the correctly rounded root ([Note: the bf16-state
    AdamW step in one pass on a CPU] in lowp_cpu.py): torch's float32 sqrt on a CPU (MKL's) is 1 ulp
    off in a fifth of the values, so there it is taken in float64 and rounded once (a float64
    root within 1 ulp rounds to the correct float32: no float32 root comes within 2^-50 of a
    midpoint); elsewhere torch's float32 sqrt (CUDA's is correctly rounded by NVIDIA's documented
    default; not checked on a GPU here). Without, torch's sqrt, as torch's AdamW
    takes it (the float32 state's step, bit for bit)."""
    if exact and x.device.type == "cpu":
        return out.copy_(x.double().sqrt_())
    return torch.sqrt(x, out=out)


def _chunk_elements(device: torch.device) -> int:
    """The most elements a chunk of the step holds ([Note: the bf16-state AdamW step on tensor lists])."""
    return CHUNK_CPU if device.type == "cpu" else CHUNK_ACCELERATOR


def _chunks(
    tensors: List[Tuple[torch.Tensor, ...]], limit: int
) -> Tuple[List[int], List[List[Tuple[int, Optional[Tuple[int, int]]]]]]:
    """The parameters of `tensors` ((param, grad, exp_avg, exp_avg_sq) each) in chunks of at most
    `limit` elements: (each chunk's size, each chunk's [(index, None for the whole tensor or
    (start, end) of its flattened elements)]). A parameter larger than `limit` is cut when its four
    tensors are contiguous (as the engine and torch make them), else it is a chunk of its own.
    A None in `tensors` (stepped elsewhere) is left out."""
    sizes: List[int] = []
    chunks: List[List] = []
    size, chunk = 0, []
    for i, four in enumerate(tensors):
        if four is None:
            continue
        n = four[0].numel()
        if n > limit and all(t.is_contiguous() for t in four):
            spans = [(a, min(a + limit, n)) for a in range(0, n, limit)]
        else:
            spans = [None]
        for span in spans:
            k = n if span is None else span[1] - span[0]
            if chunk and size + k > limit:
                sizes.append(size)
                chunks.append(chunk)
                size, chunk = 0, []
            size += k
            chunk.append((i, span))
    if chunk:
        sizes.append(size)
        chunks.append(chunk)
    return sizes, chunks


def _cut(t: torch.Tensor, cut: Optional[Tuple[int, int]]) -> torch.Tensor:
    return t if cut is None else t.view(-1)[cut[0] : cut[1]]


def _views(flat: torch.Tensor, like: List[torch.Tensor]) -> List[torch.Tensor]:
    """Consecutive views of `flat`, one of each tensor's shape."""
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view(t.shape))
        offset += n
    return out


def _local_tensors(p: torch.Tensor, state: dict) -> Tuple[torch.Tensor, ...]:
    """(param, float32 grad, exp_avg, exp_avg_sq) as the tensors that hold this rank's elements:
    a DTensor's local tensor (every operation of the step is elementwise), any other as it is."""
    grad = p.grad
    if DTensor is not None and isinstance(p, DTensor):
        if grad.placements != p.placements:  # e.g. a partial sum: made like the parameter first
            grad = grad.redistribute(p.device_mesh, p.placements)
        p, grad = p.to_local(), grad.to_local()
        state = {k: v.to_local() for k, v in state.items() if k != "step"}
    if grad.dtype != torch.float32:
        grad = grad.to(torch.float32)
    return p, grad, state["exp_avg"], state["exp_avg_sq"]


def cpu_library():
    """The compiled bf16-state loop checked against this module's torch path, or None: see
    lowp_cpu.library."""
    return lowp_cpu.library(check_cpu_loop)


@torch.no_grad()
def check_cpu_loop(lib) -> Optional[str]:
    """None when the loop gives the torch path's bits on this machine, else what differed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g) * torch.exp(torch.randn(5000, generator=g) * 3)
    x[:6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 3.3895e38])
    for key in (0, -1, 123456789):
        if not lowp_cpu.same_bits(lowp_cpu.round_bf16(lib, x, key), _torch_round(x, key)):
            return f"the rounding differs from the torch path (key {key})"
    shapes = [(37, 29), (1,), (1000,), (4099,)]
    for betas, wd in (((0.9, 0.95), 0.1), ((0.3, 0.999), 0.0)):
        runs = []
        for use in (lib, None):
            gen = torch.Generator().manual_seed(1)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
            opt = AdamWLowState(params, lr=3e-3, betas=betas, weight_decay=wd, seed=5)
            for step in range(3):
                for i, p in enumerate(params):
                    p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (i - 2)
                    if step == 1 and i == 2:
                        p.grad[3], p.grad[4] = float("nan"), float("inf")
                opt._step(use)
            runs.append([t for p in params for t in (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])])
        if not all(lowp_cpu.same_bits(a, b) for a, b in zip(*runs)):
            return f"the AdamW step differs from the torch path (betas {betas}, weight decay {wd})"
    return None
