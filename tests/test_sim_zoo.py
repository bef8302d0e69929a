"""Reference models by layer shapes and the GPU profiles that time them."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.sim.devices import DEVICES, DeviceProfile, get_device
from ringtrain.sim.models_zoo import MODELS, build_trace, get_model

pytestmark = pytest.mark.timeout(30)

# Published parameter counts: torchvision (ResNet, VGG, GoogLeNet without aux heads, DenseNet),
# Hugging Face (BERT-Large = BertModel 335,141,888 + MLM transform dense + LayerNorm 1,051,648 + decoder bias
# 30,522 + NSP head 2,050; GPT-2 XL with the LM head tied to wte), and closed forms for the LSTMs.
PARAMS = {
    "resnet50": 25_557_032,
    "resnet152": 60_192_808,
    "vgg16": 138_357_544,
    "googlenet": 6_624_904,
    "densenet121": 7_978_856,
    "bert-large": 335_141_888 + 1_051_648 + 30_522 + 2_050,
    "gpt2-xl": 1_557_611_200,
    # 2 x 1500 LSTM on 10k words: embedding, 2 x (4h(d+h) + 8h), decoder with bias
    "lstm-ptb": 10_000 * 1500 + 2 * (4 * 1500 * 3000 + 8 * 1500) + 1500 * 10_000 + 10_000,
    "lm300m": 50_000 * 2048 + 3 * (4 * 2048 * 4096 + 8 * 2048) + 2048 * 50_000 + 50_000,
}


def test_the_zoo_holds_the_nine_models():
    assert set(MODELS) == set(PARAMS)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts_are_the_published_ones(name):
    shapes = MODELS[name].shapes()
    assert sum(s.params for s in shapes) == PARAMS[name]
    assert len({s.name for s in shapes}) == len(shapes), "layer names must be unique"


def test_seed_000_model_has_about_300m_parameters_and_1_2_gb_of_gradients():
    t = build_trace("lm300m", DEVICES["v100"])
    assert t.params == 305_562_448
    assert t.grad_bytes == 4 * 305_562_448  # 1.222 GB of FP32 gradients
    assert t.batch_size == 32  # seed 000's batch size


def test_forward_flops_match_published_multiply_adds():
    conv_fc = lambda name: sum(s.flops for s in MODELS[name].shapes() if s.params and "bn" not in s.name)
    assert conv_fc("resnet50") == pytest.approx(2 * 4.09e9, rel=0.01)  # 4.09 GMAC (torchvision)
    assert conv_fc("vgg16") == pytest.approx(2 * 15.47e9, rel=0.01)  # 15.47 GMAC (torchvision)


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_backward_is_twice_forward_and_every_layer_is_timed(device):
    t = build_trace("resnet50", DEVICES[device])
    for layer in t.layers:
        assert layer.backward_s == pytest.approx(2 * layer.forward_s, rel=1e-12)
        assert layer.forward_s > 0
    assert t.optimizer_s > 0


def test_faster_devices_give_shorter_iterations():
    times = [build_trace("bert-large", DEVICES[d]).forward_s for d in ("k80", "v100", "a100", "h100")]
    assert times == sorted(times, reverse=True)


def test_layer_time_is_the_roofline_plus_overheads():
    d = DeviceProfile("x", peak_flops=100.0, efficiency=0.5, memory_bw=10.0, activation_bytes=4, precision="fp32",
                      kernel_overhead_s=1.0)
    assert d.layer_time(flops=500, nbytes=20, kernels=2) == 10.0 + 2.0  # compute-bound: 500/50
    assert d.layer_time(flops=50, nbytes=200, kernels=1) == 20.0 + 1.0  # memory-bound: 200/10


def test_batch_size_scales_compute():
    small = build_trace("vgg16", DEVICES["v100"], batch_size=16)
    large = build_trace("vgg16", DEVICES["v100"], batch_size=64)
    assert large.forward_s > 3 * small.forward_s and large.grad_bytes == small.grad_bytes


def test_bad_names_and_values_are_clear_errors():
    # (the library's words name no command-line flag: the CLI adds its own, test_sim_cli)
    with pytest.raises(ValueError, match="^unknown device 'p100'.*k80"):
        get_device("p100")
    with pytest.raises(ValueError, match="^unknown model 'alexnet'.*resnet50"):
        get_model("alexnet")
    with pytest.raises(ValueError, match="efficiency"):
        DeviceProfile("x", 1.0, 1.5, 1.0, 4, "fp32")
    with pytest.raises(ValueError, match="batch_size"):
        build_trace("resnet50", DEVICES["v100"], batch_size=0)


def test_build_trace_takes_a_device_name_and_refuses_what_is_not_one():
    # (the CLI takes --device v100: a name here raised AttributeError deep inside)
    assert build_trace("vgg16", "V100") == build_trace("vgg16", DEVICES["v100"])
    assert build_trace("vgg16", "v100", batch_size=np.int64(8)).batch_size == 8
    with pytest.raises(ValueError, match="unknown device 'p100'"):
        build_trace("vgg16", "p100")
    with pytest.raises(ValueError, match="device must be a DeviceProfile or the name of one"):
        build_trace("vgg16", 3)
    for bad in (2.5, True, 0, "8"):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            build_trace("vgg16", "v100", batch_size=bad)


@pytest.mark.parametrize("field, value", [("peak_flops", float("nan")), ("memory_bw", float("nan")),
                                          ("kernel_overhead_s", float("nan")), ("kernel_overhead_s", float("inf"))])
def test_a_device_of_nan_numbers_is_refused_naming_the_device(field, value):
    # Before: NaN passed the `<= 0` checks, and the error came later from the trace's first layer
    # ("layer conv1: forward_s and backward_s must be finite and >= 0"), naming no device number.
    numbers = dict(peak_flops=100.0, efficiency=0.5, memory_bw=10.0, kernel_overhead_s=1e-6)
    numbers[field] = value
    with pytest.raises(ValueError, match=rf"^device x: .*{field}.* must be (numbers|a finite number)"):
        DeviceProfile("x", activation_bytes=4, precision="fp32", **numbers)


def test_a_device_of_infinite_speed_costs_only_its_kernel_launches():
    # (infinity is a question a user may ask: the step's time with compute or memory free)
    d = DeviceProfile("x", peak_flops=float("inf"), efficiency=0.5, memory_bw=float("inf"), activation_bytes=4,
                      precision="fp32", kernel_overhead_s=1e-6)
    assert d.layer_time(flops=1e12, nbytes=1e9, kernels=3) == 3e-6
    assert build_trace("resnet50", d).forward_s > 0
