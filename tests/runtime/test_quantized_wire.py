"""The block-quantized wire format of ``CommPolicy`` (``comm/quantized.py``,
[Note: block-quantized wire format]): an exact round trip of values the
format represents, the stated error bound for any values, and non-finite
values kept visible. One process, no collective."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fsdp_compose import CommPolicy
from fsdp_compose.comm.quantized import FP8_E4M3, BlockQuantizer, code_dtypes

CODES = [torch.int8] + ([FP8_E4M3] if FP8_E4M3 is not None else [])
VALUE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _roundtrip(quantizer: BlockQuantizer, values: torch.Tensor, dtype=None) -> torch.Tensor:
    payload = torch.empty(quantizer.payload_bytes(values.numel()), dtype=torch.uint8)
    quantizer.encode(values, payload)
    out = torch.empty(values.numel(), dtype=dtype or values.dtype)
    quantizer.decode(payload, out)
    return out, payload


def _representable(code_dtype, numel, block, exponents, seed):
    """Codes with a full-scale element in every block, times a power of two
    per block: values the format holds exactly (their scale is that power)."""
    g = torch.Generator().manual_seed(seed)
    blocks = math.ceil(numel / block)
    if code_dtype == torch.int8:
        codes = torch.randint(-127, 128, (blocks, block), generator=g).float()
        full = 127.0
    else:
        every = torch.arange(256, dtype=torch.uint8).view(FP8_E4M3).float()
        every = every[torch.isfinite(every)]
        codes = every[torch.randint(0, every.numel(), (blocks, block), generator=g)]
        full = 448.0
    signs = torch.where(torch.rand(blocks, generator=g) < 0.5, -1.0, 1.0)
    last = (numel - 1) % block  # a full-scale element inside the real part of each block
    codes[:, 0] = full * signs
    codes[-1, last] = full * signs[-1]
    codes[-1, last + 1:] = 0
    scales = torch.tensor([2.0 ** e for e in exponents[:blocks]] +
                          [1.0] * max(0, blocks - len(exponents)))
    return (codes * scales.unsqueeze(1)).reshape(-1)[:numel], codes, scales


@settings(max_examples=60, deadline=None)
@given(code=st.sampled_from(CODES), value_dtype=st.sampled_from(VALUE_DTYPES),
       numel=st.integers(1, 700), block=st.sampled_from([4, 8, 32, 64, 256]),
       exponents=st.lists(st.integers(-12, 4), min_size=1, max_size=8),
       seed=st.integers(0, 2 ** 16))
def test_representable_values_round_trip_exactly(code, value_dtype, numel, block, exponents, seed):
    quantizer = BlockQuantizer(code, block)
    if value_dtype == torch.float16 and code != torch.int8:
        exponents = [min(e, 0) for e in exponents]  # 448 * 2**4 * 2**3 overflows fp16's range
    values, codes, scales = _representable(code, numel, block, exponents, seed)
    values = values.to(value_dtype)
    assert torch.equal(values.float(), (codes * scales.unsqueeze(1)).reshape(-1)[:numel])
    decoded, payload = _roundtrip(quantizer, values)
    assert torch.equal(decoded, values)
    blocks = math.ceil(numel / block)
    # the layout: codes, then one fp32 scale per block
    assert payload.numel() == blocks * block + 4 * blocks
    assert torch.equal(payload[blocks * block:].view(torch.float32), scales)
    stored = payload[:blocks * block].view(code).float().view(blocks, block)
    assert torch.equal(stored, codes)


@settings(max_examples=80, deadline=None)
@given(code=st.sampled_from(CODES), numel=st.integers(1, 2000),
       block=st.sampled_from([4, 16, 128, 256]), magnitude=st.floats(1e-6, 1e4),
       zeros=st.floats(0.0, 0.5), seed=st.integers(0, 2 ** 16))
def test_error_is_within_the_stated_bound(code, numel, block, magnitude, zeros, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=g) * magnitude
    values[torch.rand(numel, generator=g) < zeros] = 0.0
    quantizer = BlockQuantizer(code, block)
    decoded, _ = _roundtrip(quantizer, values)
    blocks = math.ceil(numel / block)
    padded = torch.nn.functional.pad(values, (0, blocks * block - numel)).view(blocks, block)
    absmax = padded.abs().amax(dim=1)
    bound = quantizer.error_bound(absmax).repeat_interleave(block)[:numel]
    slack = absmax.repeat_interleave(block)[:numel] * 2.0 ** -20  # fp32 arithmetic of the codec
    error = (decoded - values).abs()
    assert bool((error <= bound + slack).all()), (error - bound).max()
    assert bool((decoded[values == 0] == 0).all())


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_makes_its_block_non_finite_and_no_other(code, bad):
    quantizer = BlockQuantizer(code, 8)
    values = torch.randn(24)
    values[10] = bad
    decoded, _ = _roundtrip(quantizer, values)
    assert not bool(torch.isfinite(decoded[8:16]).any())
    assert bool(torch.isfinite(decoded[:8]).all() and torch.isfinite(decoded[16:]).all())


def test_decode_into_a_lower_precision():
    quantizer = BlockQuantizer(torch.int8, 16)
    values = torch.randn(100)
    exact, _ = _roundtrip(quantizer, values)
    narrow, _ = _roundtrip(quantizer, values, dtype=torch.bfloat16)
    assert torch.equal(narrow, exact.to(torch.bfloat16))


def test_bad_policies_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="CommPolicy.all_gather must be one of"):
        CommPolicy(all_gather=torch.int4 if hasattr(torch, "int4") else torch.int16)
    with pytest.raises(ValueError, match="CommPolicy.reduce_scatter must be one of"):
        CommPolicy(reduce_scatter=torch.bfloat16)
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 4"):
        CommPolicy(all_gather=torch.int8, block_size=10)
    assert set(code_dtypes()) == set(CODES)
