"""The 4-bit frozen base of a QLoRA run (lm.model.quant.quantize_base): NF4 and int4 in groups of
64 inputs with double-quantized scales, their dequantization by hand and its error bounds."""

import numpy as np
import pytest

from lm.model.qtensor import NF4, unpack_int4
from lm.model.quant import BASE_GROUP, quantize


def test_nf4_levels_are_symmetric_quantiles_with_an_exact_zero():
    assert len(NF4) == 16 and NF4[0] == -1.0 and NF4[7] == 0.0 and NF4[15] == 1.0
    assert all(a < b for a, b in zip(NF4, NF4[1:]))


def test_nf4_by_hand_values_on_levels_come_back_exactly():
    # one group of 16 inputs, one output: w = NF4 levels times 0.5 (absmax 0.5 = the scale)
    w = (np.asarray(NF4, np.float32) * 0.5).reshape(16, 1)
    q = quantize(w, 4, -2, 1, group=16, code="nf4")
    assert q.values.shape == (8, 1) and q.values.dtype == np.uint8 and q.scale.shape == (1, 1)
    np.testing.assert_allclose(np.asarray(q.scale), [[0.5]])
    np.testing.assert_array_equal(np.asarray(unpack_int4(q.values, 0))[:, 0] + 8, np.arange(16))
    np.testing.assert_allclose(np.asarray(q.dequantize()), w, rtol=1e-6)
    # normalised by the absmax 0.5: 0.18, 0.26, -0.6 go to the nearest levels 0.1609, 0.2461, -0.5251
    w2 = np.asarray([[0.5], [0.09], [0.13], [-0.3]], np.float32)
    got = np.asarray(quantize(w2, 4, -2, 1, group=4, code="nf4").dequantize())[:, 0]
    np.testing.assert_allclose(got, [0.5, NF4[9] * 0.5, NF4[10] * 0.5, NF4[2] * 0.5], rtol=1e-6)


def test_int4_by_hand_and_double_quantized_scales_round_up():
    w = np.asarray([[7.0], [-3.5], [1.0], [0.0]], np.float32)  # absmax 7: scale 1
    np.testing.assert_allclose(np.asarray(quantize(w, 4, -2, 1, group=4).dequantize()), [[7], [-4], [1], [0]])
    # two groups with absmax 7 and 0.7: codes 255 and ceil(25.5) = 26 of scale_max 1
    w = np.asarray([[7.0], [1.0], [0.7], [0.1]], np.float32)
    q = quantize(w, 4, -2, 1, group=2, double=True)
    assert q.scale.dtype == np.uint8 and q.scale_max.shape == (1, 1)
    np.testing.assert_array_equal(np.asarray(q.scale)[:, 0], [255, 26])
    assert float(q.group_scale()[1, 0]) >= 0.1  # never below the group's absmax / 7
    np.testing.assert_allclose(np.asarray(q.dequantize())[:, 0], [7, 1, 26 / 255 * 7, 26 / 255], rtol=1e-6)


@pytest.mark.parametrize("code", ["nf4", "int"])
@pytest.mark.parametrize("double", [False, True])
def test_error_on_random_normal_weights_is_within_half_a_level(code, double):
    """|w - dequantized| <= half the widest gap between levels x the group's absmax (NF4: -1 to
    -0.6962; int4: a step of absmax / 7), the scale a little wider when double-quantized; the
    relative RMS error of NF4 is below int4's."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 512, 96)).astype(np.float32) * 0.02
    q = quantize(w, 4, -2, 1, group=BASE_GROUP, code=code, double=double)
    err = np.abs(np.asarray(q.dequantize()) - w).reshape(3, 512 // BASE_GROUP, BASE_GROUP, 96)
    absmax = np.abs(w).reshape(err.shape).max(axis=2, keepdims=True)
    widest = (NF4[1] - NF4[0]) / 2 if code == "nf4" else 0.5 / 7
    slack = 1 + (1 / 255 * 3 if double else 0)  # a scale's code rounds up by < 1/255 of its channel's largest
    assert (err <= widest * absmax * slack + 1e-9).all()
    rms = np.sqrt((err**2).mean() / (w**2).mean())
    assert rms < (0.095 if code == "nf4" else 0.111)  # measured: NF4 0.092, int4 0.108 (either scale form)


def test_double_quantized_scales_take_a_quarter_of_the_bytes():
    w = np.zeros((4096, 64), np.float32) + 0.01
    plain = quantize(w, 4, -2, 1, group=BASE_GROUP, code="nf4")
    double = quantize(w, 4, -2, 1, group=BASE_GROUP, code="nf4", double=True)
    values = 4096 * 64 // 2
    assert plain.nbytes == values + 4096 // 64 * 64 * 4  # float32 per group: 0.5 bits a weight
    assert double.nbytes == values + 4096 // 64 * 64 + 64 * 4  # uint8 per group + float32 per channel
