"""The bf16-state AdamW step and the stochastic rounding as one C loop on a CPU: [Note: the
bf16-state AdamW step in one pass on a CPU].

[Note: the bf16-state AdamW step in one pass on a CPU]
Eager torch makes the bf16-state step in passes over memory: the state read into float32, AdamW's
operations one at a time, then the rounding's hash, a dozen int32 operations over both moments
([Note: the bf16-state AdamW step on tensor lists] in lowp.py). On a CPU that is 2.2-3x torch's
foreach AdamW however the chunks are cut; the arithmetic is what costs, not Python. Here each
element is read once and written once: a C loop (below, `_SOURCE`) reads the bfloat16 moments,
makes torch's AdamW update in float32 and rounds both moments back with the same hash, in
registers. It is compiled by the system's C compiler (`$CC`, else `cc`) at the first bf16-state
step of a process, into the user's cache (`$XDG_CACHE_HOME/framework/kernels`, else
~/.cache/framework/kernels; a file per source, compiler and CPU, so a shared home directory on
machines of several CPU kinds keeps one each) and loaded with ctypes: no torch headers (a
compile takes about a second), no download, nothing to install.

Its bits are the torch path's. Every float32 operation is written as torch's CPU kernels make it
(found by comparing all elements on 1M random values of wide range): lerp is one fused
multiply-add, `w (g - m) + m` (`(w - 1)(g - m) + g` for a weight of 0.5 or more), addcmul
`fma(c g, g, v)`, addcdiv `p + (s m) / d`, the rest single IEEE operations; the compiler may not
fuse any others (`-ffp-contract=off`). One operation no loop of ours can reproduce: torch's
float32 sqrt on a CPU (MKL's) is 1 ulp off the correctly rounded root in about a fifth of the
values (measured on 100k), so with bf16 state both paths take the correctly rounded root
(`sqrtf` here, lowp.py's `_sqrt` there). Because a torch build whose kernels make some other
operation otherwise would give other bits, the loaded loop is checked once per process against
the torch path on a few thousand values (every branch: both lerp forms, weight decay on and off,
NaN, infinities): where any bit differs, or no compiler is found, or the compile fails, the step
keeps the torch path (the reason logged once). tests/unit/test_optim_lowp_cpu.py compares the
two paths bit for bit over steps. Work is split over `torch.get_num_threads()` threads in whole
element ranges (every element is independent, so the split changes no bit).

On a GPU none of this runs: a CUDA tensor takes the torch path (torch's foreach operations, one
launch each per chunk of 2^24 elements), which reads nothing on the host.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from typing import Callable, List, Optional

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* float32 -> bfloat16 bits, stochastically rounded with the hash of (key, the value's bits):
   [Note: bf16 optimizer state and its rounding] in framework/optim/lowp.py; NaN stays NaN */
static inline uint16_t round_bf16(float x, uint32_t key) {
    uint32_t b;
    memcpy(&b, &x, 4);
    uint32_t h = b ^ key;
    h = ((h >> 16) ^ h) * 0x45D9F3Bu;
    h = ((h >> 16) ^ h) * 0x45D9F3Bu;
    h = ((h >> 16) ^ h) & 0xFFFFu;
    uint32_t r = (b + h) >> 16;
    return (uint16_t)(x != x ? 0x7FC0u : r);
}

static inline float widen(uint16_t u) {
    uint32_t b = (uint32_t)u << 16;
    float x;
    memcpy(&x, &b, 4);
    return x;
}

typedef struct {
    float *param;
    const float *grad;
    uint16_t *m;
    uint16_t *v;
    int64_t n;
    uint32_t key_m, key_v;
    float step_size, bc2_sqrt;
} tensor_t;

typedef struct {
    float w1, c2, b2, eps, decay;
    int small_w1;
} hyper_t;

/* torch's AdamW, operation for operation as its CPU kernels round, on elements [lo, hi) of one
   tensor; `decay` is 1 where there is no weight decay (p * 1 is p) */
#define ADAMW_LOOP(LERP)                                                        \
    for (int64_t i = lo; i < hi; i++) {                                         \
        float gi = g[i], m = widen(ms[i]), v = widen(vs[i]);                    \
        m = LERP;                                                               \
        v = fmaf(c2 * gi, gi, v * b2);           /* mul, then addcmul */        \
        float d = sqrtf(v) / bc + eps;                                          \
        p[i] = p[i] * decay + (ss * m) / d;      /* mul, then addcdiv */        \
        ms[i] = round_bf16(m, km);                                              \
        vs[i] = round_bf16(v, kv);                                              \
    }

static void adamw_span(const tensor_t *t, const hyper_t *h, int64_t lo, int64_t hi) {
    float *restrict p = t->param;
    const float *restrict g = t->grad;
    uint16_t *restrict ms = t->m;
    uint16_t *restrict vs = t->v;
    const float w1 = h->w1, w1m = h->w1 - 1.0f, c2 = h->c2, b2 = h->b2, eps = h->eps, decay = h->decay;
    const float ss = t->step_size, bc = t->bc2_sqrt;
    const uint32_t km = t->key_m, kv = t->key_v;
    if (h->small_w1)
        ADAMW_LOOP(fmaf(w1, gi - m, m))   /* lerp, weight < 0.5 */
    else
        ADAMW_LOOP(fmaf(w1m, gi - m, gi)) /* lerp, weight >= 0.5 */
}

typedef struct {
    const tensor_t *ts;
    int64_t count;
    const hyper_t *h;
    const float *src;      /* rounding only: float32 in, bf16 out, one key */
    uint16_t *dst;
    uint32_t key;
    int64_t lo, hi;        /* this thread's elements, counted over all tensors */
} work_t;

static void *adamw_work(void *arg) {
    const work_t *w = (const work_t *)arg;
    int64_t start = 0;
    for (int64_t k = 0; k < w->count && start < w->hi; k++) {
        int64_t n = w->ts[k].n, end = start + n;
        int64_t lo = w->lo > start ? w->lo - start : 0, hi = w->hi < end ? w->hi - start : n;
        if (lo < hi) adamw_span(&w->ts[k], w->h, lo, hi);
        start = end;
    }
    return 0;
}

static void *round_work(void *arg) {
    const work_t *w = (const work_t *)arg;
    for (int64_t i = w->lo; i < w->hi; i++) w->dst[i] = round_bf16(w->src[i], w->key);
    return 0;
}

#define MAX_THREADS 256

static void run(void *(*fn)(void *), work_t base, int64_t total, int threads) {
    const int64_t per_thread_min = 1 << 16; /* below this a thread costs more than it saves */
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > total / per_thread_min) threads = (int)(total / per_thread_min);
    if (threads < 2) {
        base.lo = 0;
        base.hi = total;
        fn(&base);
        return;
    }
    pthread_t ids[MAX_THREADS];
    work_t works[MAX_THREADS];
    int started[MAX_THREADS];
    for (int i = 0; i < threads; i++) {
        works[i] = base;
        works[i].lo = total * i / threads;
        works[i].hi = total * (i + 1) / threads;
        started[i] = i > 0 && pthread_create(&ids[i], 0, fn, &works[i]) == 0;
        if (i > 0 && !started[i]) fn(&works[i]); /* no thread: this one does it */
    }
    fn(&works[0]);
    for (int i = 1; i < threads; i++)
        if (started[i]) pthread_join(ids[i], 0);
}

/* One AdamW step of `count` tensors: param (float32), grad (float32), exp_avg and exp_avg_sq
   (bfloat16 bits), all contiguous, updated in place. Per tensor: its element count, its two
   rounding keys, its step size (-lr / (1 - b1^t)) and sqrt(1 - b2^t), as float32. */
void lowp_adamw_step(const int64_t *params, const int64_t *grads, const int64_t *ms, const int64_t *vs,
                     const int64_t *numels, const int32_t *keys_m, const int32_t *keys_v,
                     const float *step_sizes, const float *bc2_sqrts, int64_t count,
                     float w1, float c2, float b2, float eps, float decay, int decays, int threads) {
    tensor_t ts_stack[64];
    tensor_t *ts = ts_stack;
    tensor_t *heap = 0;
    if (count > 64) {
        heap = (tensor_t *)__builtin_malloc(sizeof(tensor_t) * (size_t)count);
        if (!heap) return;
        ts = heap;
    }
    int64_t total = 0;
    for (int64_t k = 0; k < count; k++) {
        ts[k].param = (float *)(intptr_t)params[k];
        ts[k].grad = (const float *)(intptr_t)grads[k];
        ts[k].m = (uint16_t *)(intptr_t)ms[k];
        ts[k].v = (uint16_t *)(intptr_t)vs[k];
        ts[k].n = numels[k];
        ts[k].key_m = (uint32_t)keys_m[k];
        ts[k].key_v = (uint32_t)keys_v[k];
        ts[k].step_size = step_sizes[k];
        ts[k].bc2_sqrt = bc2_sqrts[k];
        total += numels[k];
    }
    hyper_t h = {w1, c2, b2, eps, decays ? decay : 1.0f, fabsf(w1) < 0.5f};
    work_t base;
    memset(&base, 0, sizeof base);
    base.ts = ts;
    base.count = count;
    base.h = &h;
    run(adamw_work, base, total, threads);
    if (heap) __builtin_free(heap);
}

/* `n` float32 values rounded stochastically to bfloat16 bits with one key (read where it lies) */
void lowp_round_bf16(const float *src, uint16_t *dst, int64_t n, const int32_t *key, int threads) {
    work_t base;
    memset(&base, 0, sizeof base);
    base.src = src;
    base.dst = dst;
    base.key = (uint32_t)*key;
    run(round_work, base, n, threads);
}
"""

# -O3 vectorizes the loops; -ffp-contract=off: no multiply-add fused but the fmaf written out (the
# torch path's bits); -fno-math-errno lets sqrtf be the instruction (it sets no errno either way
# on a non-negative sum). -march=native is safe because the cached file is keyed by the CPU.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread"]

_lock = threading.Lock()
_state: dict = {}  # "lib": the checked library or None, "why": the reason when None


class _BuildError(Exception):
    """The compiler refused the source (its message kept)."""


def compiler() -> Optional[str]:
    """The C compiler to build the loop with: `$CC`, else `cc`; None when there is none."""
    return shutil.which(os.environ.get("CC") or "cc")


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.processor() + platform.machine()


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "framework", "kernels")


def _private(path: str) -> bool:
    """True for a real file or folder (not a link) this user owns that no one else can write to: a
    library is loaded, i.e. its code run, only from such a file in such a folder."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(cc: str) -> str:
    """The shared library's path, compiled into the cache unless it is there already."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), version, _cpu_id()]).encode()).hexdigest()[:16]
    folder = _cache_dir()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if not _private(folder):
        # A cache another user can write to (or a link in its place) could hold a library of theirs:
        # build into a folder of this process's own instead (a second's compile, every process).
        folder = tempfile.mkdtemp(prefix="framework-kernels-")
    path = os.path.join(folder, f"lowp_{digest}.so")
    if os.path.lexists(path):
        if _private(path):
            return path
        os.unlink(path)  # not ours, or writable by others: replaced by our own build
    # written under a name of its own, then renamed: ranks compiling at once each install a whole file
    fd, src = tempfile.mkstemp(suffix=".c", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(_SOURCE)
    tmp = src[:-2] + ".so"
    try:
        done = subprocess.run([cc, *_FLAGS, src, "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise _BuildError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # whatever the umask: no one else may change what is loaded
        os.replace(tmp, path)
    finally:
        for leftover in (src, tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return path


def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.lowp_adamw_step.argtypes = [p] * 9 + [i64] + [f32] * 5 + [ctypes.c_int, ctypes.c_int]
    lib.lowp_adamw_step.restype = None
    lib.lowp_round_bf16.argtypes = [p, p, i64, p, ctypes.c_int]
    lib.lowp_round_bf16.restype = None
    return lib


def library(check: Callable[[ctypes.CDLL], Optional[str]]) -> Optional[ctypes.CDLL]:
    """The compiled loop, built, loaded and checked against the torch path once per process
    (`check(lib)`: None when its bits are the torch path's, else what differed; lowp.py's
    `cpu_library` passes its own); None (the torch path) where there is no compiler, the compile
    fails, or any bit differs."""
    with _lock:
        if "lib" not in _state:
            lib, why, cc = None, None, compiler()
            if cc is None:
                why = "no C compiler ($CC or cc)"
            else:
                try:
                    lib = _load(_build(cc))
                except (OSError, _BuildError, subprocess.SubprocessError) as e:
                    why = f"compile or load failed: {e}"
                else:  # anything the check raises is a bug of ours: it keeps its traceback
                    why = check(lib)
            if why is not None:
                log.info("bf16-state AdamW on CPU: the torch path (%s)", why)
            _state.update(lib=lib if why is None else None, why=why)
        return _state["lib"]


def unavailable_reason() -> Optional[str]:
    """Why `library(...)` was None, once it was asked; else None."""
    return _state.get("why")


def _ptr(ts: List[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)


def fits(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the loop can step this parameter: all on the CPU, float32 parameter and gradient,
    bfloat16 state, all contiguous."""
    return (
        p.device.type == "cpu"
        and p.dtype == grad.dtype == torch.float32
        and m.dtype == v.dtype == torch.bfloat16
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (p, grad, m, v))
    )


def adamw_step(
    lib: ctypes.CDLL,
    tensors: List[tuple],
    keys_m: torch.Tensor,
    keys_v: torch.Tensor,
    step_size: torch.Tensor,
    bc2_sqrt: torch.Tensor,
    *,
    lr: float,
    betas: tuple,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step of `tensors` ((param, grad, exp_avg, exp_avg_sq) each, all `fits`), with each
    tensor's rounding keys (int32), step size and sqrt(1 - b2^t) (float32), all contiguous CPU
    tensors of one element per tensor: [Note: the bf16-state AdamW step in one pass on a CPU]."""
    b1, b2 = betas
    cols = list(zip(*tensors))
    ptrs = [_ptr(list(c)) for c in cols]
    numels = torch.tensor([t.numel() for t in cols[0]], dtype=torch.int64)
    small = [keys_m, keys_v, step_size, bc2_sqrt]
    assert all(t.is_contiguous() and t.numel() == len(tensors) for t in small)
    lib.lowp_adamw_step(
        *(t.data_ptr() for t in ptrs),
        numels.data_ptr(),
        *(t.data_ptr() for t in small),
        len(tensors),
        # the scalars as torch's kernels take them: Python floats cast to float32
        1 - b1,
        1 - b2,
        b2,
        eps,
        1 - lr * weight_decay,
        int(lr * weight_decay != 0),
        torch.get_num_threads(),
    )
    # written behind autograd's back: counted as the in-place writes they are
    torch.autograd.graph.increment_version([t for four in tensors for t in (four[0], four[2], four[3])])


def round_bf16(lib: ctypes.CDLL, x: torch.Tensor, key) -> torch.Tensor:
    """`x` (contiguous float32 on the CPU) stochastically rounded to bfloat16 with `key` (an int, of
    which the low 32 bits count, or a 0-d int32 tensor on the CPU, read by the loop where it lies), as
    `stochastic_round_bf16`'s torch path rounds it."""
    if isinstance(key, torch.Tensor):
        key = key.to(torch.int32).contiguous()
    else:
        key = torch.tensor((key + 2**31) % 2**32 - 2**31, dtype=torch.int32)  # its low 32 bits
    out = torch.empty_like(x, dtype=torch.bfloat16)
    lib.lowp_round_bf16(x.data_ptr(), out.data_ptr(), x.numel(), key.data_ptr(), torch.get_num_threads())
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit where not NaN, NaN at the same places (a NaN's payload is not kept: torch's
    own conversions to bfloat16 make 0x7FC0 or 0xFFFF)."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))
