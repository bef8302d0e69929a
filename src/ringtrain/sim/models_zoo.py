"""Reference models described by their layer shapes, without weights.

Words used here:

* **shape** (``LayerShape``) — one layer as arithmetic: its parameter count, its forward
  FLOPs per sample (a multiply-add counts 2), the activation elements it reads and writes
  per sample, and how many kernels it launches. Nothing else about the model is kept.
* **zoo** — the named builders below; ``build_trace(name, device)`` turns a model's shapes
  into a ``Trace`` with the device's roofline (see ``devices``): backward is 2x the forward
  FLOPs and bytes. Gradients are FP32 (4 bytes per parameter), as in seed 000's
  "300 million parameters, 1.2 gigabytes". The optimizer step is SGD with momentum on FP32
  master weights: read weight, gradient, momentum and write weight, momentum — 20 bytes
  per parameter at device-memory bandwidth.

Layer names follow the module names of torchvision / Hugging Face so that a profiled trace
and a zoo trace of the same model line up. Parameter counts are exact and are tested against
the published ones (ResNet-50 25,557,032; VGG-16 138,357,544; GPT-2 XL 1,557,611,200, ...).
Activations (ReLU, GELU, dropout) are not separate layers: they are fused or in place in
the fast implementations, and they carry no gradient.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

from .devices import DeviceProfile, get_device
from .traces import Layer, Trace

GRAD_BYTES_PER_PARAM = 4
OPTIMIZER_BYTES_PER_PARAM = 20


@dataclass(frozen=True, slots=True)
class LayerShape:
    name: str
    params: int
    """Trainable parameters."""
    flops: float
    """Forward FLOPs per sample."""
    act_elems: float
    """Activation elements read and written per sample in forward."""
    kernels: int = 1
    """Kernel launches in forward."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    description: str
    batch_size: int
    sample_unit: str
    shapes: Callable[[], list[LayerShape]]


# ---------------------------------------------------------------- building blocks
# Each takes the input's (channels, height, width) and returns (shape, output chw).

Chw = tuple[int, int, int]


def _out(size: int, k: int, stride: int, pad: int, ceil: bool = False) -> int:
    span = size + 2 * pad - k
    return (-(-span // stride) if ceil else span // stride) + 1


def conv(name: str, x: Chw, cout: int, k: int, stride: int = 1, pad: int = 0, bias: bool = False) -> tuple[LayerShape, Chw]:
    cin, h, w = x
    ho, wo = _out(h, k, stride, pad), _out(w, k, stride, pad)
    params = k * k * cin * cout + (cout if bias else 0)
    flops = 2 * k * k * cin * cout * ho * wo
    return LayerShape(name, params, flops, cin * h * w + cout * ho * wo), (cout, ho, wo)


def norm(name: str, x: Chw) -> LayerShape:
    c, h, w = x
    return LayerShape(name, 2 * c, 4 * c * h * w, 2 * c * h * w)


def pool(name: str, x: Chw, k: int, stride: int, pad: int = 0, ceil: bool = False) -> tuple[LayerShape, Chw]:
    c, h, w = x
    ho, wo = _out(h, k, stride, pad, ceil), _out(w, k, stride, pad, ceil)
    return LayerShape(name, 0, k * k * c * ho * wo, c * h * w + c * ho * wo), (c, ho, wo)


def linear(name: str, din: int, dout: int, tokens: int = 1, bias: bool = True) -> LayerShape:
    return LayerShape(name, din * dout + (dout if bias else 0), 2 * din * dout * tokens, (din + dout) * tokens)


def layer_norm(name: str, d: int, tokens: int) -> LayerShape:
    return LayerShape(name, 2 * d, 5 * d * tokens, 2 * d * tokens)


def embedding(name: str, rows: int, d: int, tokens: int) -> LayerShape:
    return LayerShape(name, rows * d, 0, 2 * d * tokens)


def lstm(name: str, din: int, h: int, steps: int) -> LayerShape:
    # PyTorch/cuDNN LSTM: four gates, input and recurrent weights, two bias vectors;
    # one recurrent step is one kernel, so a layer launches `steps` kernels.
    params = 4 * h * (din + h) + 8 * h
    return LayerShape(name, params, 2 * 4 * h * (din + h) * steps, (din + 5 * h) * steps, kernels=steps)


# ---------------------------------------------------------------- convolutional networks

def _resnet(blocks: list[int]) -> list[LayerShape]:
    # torchvision ResNet v1.5 with bottleneck blocks (stride on the 3x3 convolution).
    out: list[LayerShape] = []
    s, x = conv("conv1", (3, 224, 224), 64, 7, 2, 3)
    out += [s, norm("bn1", x)]
    s, x = pool("maxpool", x, 3, 2, 1)
    out.append(s)
    for stage, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512)), start=1):
        for b in range(n):
            p = f"layer{stage}.{b}"
            stride = 2 if (b == 0 and stage > 1) else 1
            inp = x
            s1, y = conv(f"{p}.conv1", x, width, 1)
            s2, y2 = conv(f"{p}.conv2", y, width, 3, stride, 1)
            s3, y3 = conv(f"{p}.conv3", y2, 4 * width, 1)
            out += [s1, norm(f"{p}.bn1", y), s2, norm(f"{p}.bn2", y2), s3, norm(f"{p}.bn3", y3)]
            if b == 0:
                sd, yd = conv(f"{p}.downsample.0", inp, 4 * width, 1, stride)
                out += [sd, norm(f"{p}.downsample.1", yd)]
            x = y3
    s, x = pool("avgpool", x, x[1], 1)
    out += [s, linear("fc", 2048, 1000)]
    return out


def resnet50() -> list[LayerShape]:
    return _resnet([3, 4, 6, 3])


def resnet152() -> list[LayerShape]:
    return _resnet([3, 8, 36, 3])


def vgg16() -> list[LayerShape]:
    out: list[LayerShape] = []
    x: Chw = (3, 224, 224)
    i = 0
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            s, x = pool(f"features.{i}", x, 2, 2)
            i += 1
        else:
            s, x = conv(f"features.{i}", x, int(v), 3, 1, 1, bias=True)
            i += 2  # torchvision numbers the ReLU after each convolution
        out.append(s)
    out += [linear("classifier.0", 512 * 7 * 7, 4096), linear("classifier.3", 4096, 4096), linear("classifier.6", 4096, 1000)]
    return out


def _basic(name: str, x: Chw, cout: int, k: int, stride: int = 1, pad: int = 0) -> tuple[list[LayerShape], Chw]:
    s, y = conv(f"{name}.conv", x, cout, k, stride, pad)
    return [s, norm(f"{name}.bn", y)], y


def googlenet() -> list[LayerShape]:
    # torchvision's GoogLeNet without auxiliary classifiers: convolution + batch norm units,
    # and (as torchvision keeps for compatibility) a 3x3 convolution in the "5x5" branch.
    out: list[LayerShape] = []
    s, x = _basic("conv1", (3, 224, 224), 64, 7, 2, 3)
    out += s
    p, x = pool("maxpool1", x, 3, 2, ceil=True)
    out.append(p)
    s, x = _basic("conv2", x, 64, 1)
    out += s
    s, x = _basic("conv3", x, 192, 3, 1, 1)
    out += s
    p, x = pool("maxpool2", x, 3, 2, ceil=True)
    out.append(p)
    table = [
        ("inception3a", 64, 96, 128, 16, 32, 32), ("inception3b", 128, 128, 192, 32, 96, 64), ("maxpool3", 3),
        ("inception4a", 192, 96, 208, 16, 48, 64), ("inception4b", 160, 112, 224, 24, 64, 64),
        ("inception4c", 128, 128, 256, 24, 64, 64), ("inception4d", 112, 144, 288, 32, 64, 64),
        ("inception4e", 256, 160, 320, 32, 128, 128), ("maxpool4", 2),
        ("inception5a", 256, 160, 320, 32, 128, 128), ("inception5b", 384, 192, 384, 48, 128, 128),
    ]
    for row in table:
        if len(row) == 2:
            p, x = pool(row[0], x, row[1], 2, ceil=True)
            out.append(p)
            continue
        name, c1, c3r, c3, c5r, c5, cp = row
        b1, y1 = _basic(f"{name}.branch1", x, c1, 1)
        b2a, y = _basic(f"{name}.branch2.0", x, c3r, 1)
        b2b, y2 = _basic(f"{name}.branch2.1", y, c3, 3, 1, 1)
        b3a, y = _basic(f"{name}.branch3.0", x, c5r, 1)
        b3b, y3 = _basic(f"{name}.branch3.1", y, c5, 3, 1, 1)
        pp, y = pool(f"{name}.branch4.0", x, 3, 1, 1, ceil=True)
        b4, y4 = _basic(f"{name}.branch4.1", y, cp, 1)
        out += b1 + b2a + b2b + b3a + b3b + [pp] + b4
        x = (y1[0] + y2[0] + y3[0] + y4[0], y1[1], y1[2])
    p, x = pool("avgpool", x, x[1], 1)
    out += [p, linear("fc", 1024, 1000)]
    return out


def densenet121() -> list[LayerShape]:
    # torchvision DenseNet-121: growth 32, bottleneck 4 x growth, compression 0.5.
    growth, bn_size = 32, 4
    out: list[LayerShape] = []
    s, x = conv("features.conv0", (3, 224, 224), 64, 7, 2, 3)
    out += [s, norm("features.norm0", x)]
    p, x = pool("features.pool0", x, 3, 2, 1)
    out.append(p)
    for i, n in enumerate((6, 12, 24, 16), start=1):
        for j in range(1, n + 1):
            name = f"features.denseblock{i}.denselayer{j}"
            out.append(norm(f"{name}.norm1", x))
            s1, y = conv(f"{name}.conv1", x, bn_size * growth, 1)
            s2, y2 = conv(f"{name}.conv2", y, growth, 3, 1, 1)
            out += [s1, norm(f"{name}.norm2", y), s2]
            x = (x[0] + growth, x[1], x[2])
        if i < 4:
            name = f"features.transition{i}"
            out.append(norm(f"{name}.norm", x))
            s, y = conv(f"{name}.conv", x, x[0] // 2, 1)
            p, x = pool(f"{name}.pool", y, 2, 2)
            out += [s, p]
    out.append(norm("features.norm5", x))
    p, x = pool("avgpool", x, x[1], 1)
    out += [p, linear("classifier", 1024, 1000)]
    return out


# ---------------------------------------------------------------- transformers

def _attention_core(name: str, heads: int, d: int, seq: int) -> LayerShape:
    # Q K^T and (softmax) V: two batched matmuls of 2*seq*seq*d FLOPs each, plus the
    # softmax over heads*seq*seq scores; no parameters.
    return LayerShape(name, 0, 4 * seq * seq * d, 2 * heads * seq * seq + 4 * seq * d, kernels=3)


BERT_LARGE = dict(layers=24, d=1024, heads=16, ffn=4096, vocab=30522, positions=512, seq=128)


def bert_large() -> list[LayerShape]:
    # Hugging Face BertForPreTraining (bert-large-uncased): the encoder, pooler, masked-LM
    # head (decoder weight tied to the word embeddings; its bias is its own) and the
    # next-sentence head. The LM head is computed over every token, as HF does.
    c = BERT_LARGE
    d, s, f = c["d"], c["seq"], c["ffn"]
    out = [
        embedding("bert.embeddings.word_embeddings", c["vocab"], d, s),
        embedding("bert.embeddings.position_embeddings", c["positions"], d, s),
        embedding("bert.embeddings.token_type_embeddings", 2, d, s),
        layer_norm("bert.embeddings.LayerNorm", d, s),
    ]
    for i in range(c["layers"]):
        p = f"bert.encoder.layer.{i}"
        out += [
            linear(f"{p}.attention.self.query", d, d, s),
            linear(f"{p}.attention.self.key", d, d, s),
            linear(f"{p}.attention.self.value", d, d, s),
            _attention_core(f"{p}.attention.self.core", c["heads"], d, s),
            linear(f"{p}.attention.output.dense", d, d, s),
            layer_norm(f"{p}.attention.output.LayerNorm", d, s),
            linear(f"{p}.intermediate.dense", d, f, s),
            linear(f"{p}.output.dense", f, d, s),
            layer_norm(f"{p}.output.LayerNorm", d, s),
        ]
    out += [
        linear("bert.pooler.dense", d, d, 1),
        linear("cls.predictions.transform.dense", d, d, s),
        layer_norm("cls.predictions.transform.LayerNorm", d, s),
        LayerShape("cls.predictions.decoder", c["vocab"], 2 * d * c["vocab"] * s, (d + c["vocab"]) * s),
        linear("cls.seq_relationship", d, 2, 1),
    ]
    return out


GPT2_XL = dict(layers=48, d=1600, heads=25, vocab=50257, positions=1024, seq=1024)


def gpt2_xl() -> list[LayerShape]:
    # Hugging Face GPT2LMHeadModel "gpt2-xl" (1.5B): Conv1D layers are linear maps; the LM
    # head's weight is tied to wte, so it adds FLOPs but no parameters.
    c = GPT2_XL
    d, s = c["d"], c["seq"]
    out = [embedding("transformer.wte", c["vocab"], d, s), embedding("transformer.wpe", c["positions"], d, s)]
    for i in range(c["layers"]):
        p = f"transformer.h.{i}"
        out += [
            layer_norm(f"{p}.ln_1", d, s),
            linear(f"{p}.attn.c_attn", d, 3 * d, s),
            _attention_core(f"{p}.attn.core", c["heads"], d, s),
            linear(f"{p}.attn.c_proj", d, d, s),
            layer_norm(f"{p}.ln_2", d, s),
            linear(f"{p}.mlp.c_fc", d, 4 * d, s),
            linear(f"{p}.mlp.c_proj", 4 * d, d, s),
        ]
    out += [
        layer_norm("transformer.ln_f", d, s),
        LayerShape("lm_head", 0, 2 * d * c["vocab"] * s, (d + c["vocab"]) * s),
    ]
    return out


# ---------------------------------------------------------------- recurrent language models

def _lstm_lm(vocab: int, d: int, hidden: int, layers: int, steps: int) -> list[LayerShape]:
    out = [embedding("encoder", vocab, d, steps)]
    din = d
    for i in range(layers):
        out.append(lstm(f"rnn.layer{i}", din, hidden, steps))
        din = hidden
    out.append(linear("decoder", hidden, vocab, steps))
    return out


def lstm_ptb() -> list[LayerShape]:
    # Zaremba, Sutskever, Vinyals 2014, "large" PTB model: 2 x 1500 LSTM, 10k words, 35 steps.
    return _lstm_lm(vocab=10_000, d=1500, hidden=1500, layers=2, steps=35)


def lm300m() -> list[LayerShape]:
    # Seed 000's language model "with approximately 300 million learnable parameters"
    # (1.2 GB of FP32 gradients): a 50,000-word vocabulary, 2048-wide embeddings, three
    # 2048-unit LSTM layers and an untied softmax — 305,562,448 parameters, 1.22 GB.
    return _lstm_lm(vocab=50_000, d=2048, hidden=2048, layers=3, steps=64)


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("resnet50", "ResNet-50, 224x224 ImageNet", 64, "images", resnet50),
        ModelSpec("resnet152", "ResNet-152, 224x224 ImageNet", 32, "images", resnet152),
        ModelSpec("vgg16", "VGG-16, 224x224 ImageNet", 32, "images", vgg16),
        ModelSpec("googlenet", "GoogLeNet (torchvision, batch norm), 224x224", 64, "images", googlenet),
        ModelSpec("densenet121", "DenseNet-121, 224x224 ImageNet", 32, "images", densenet121),
        ModelSpec("bert-large", "BERT-Large pre-training, 128 tokens", 32, "sequences", bert_large),
        ModelSpec("gpt2-xl", "GPT-2 1.5B, 1024 tokens", 4, "sequences", gpt2_xl),
        ModelSpec("lstm-ptb", "2x1500 LSTM language model (PTB large), 35 steps", 20, "sequences", lstm_ptb),
        ModelSpec("lm300m", "seed 000's 300M-parameter LSTM language model, 64 steps", 32, "sequences", lm300m),
    )
}


def get_model(name: str) -> ModelSpec:
    key = name.strip().lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)} or give a trace file (.json/.csv)")
    return MODELS[key]


def build_trace(name: str, device: DeviceProfile | str, batch_size: int | None = None) -> Trace:
    """The trace of zoo model ``name`` on ``device`` (a profile, or its name in ``DEVICES``) at
    ``batch_size`` samples per GPU."""
    spec = get_model(name)
    if isinstance(device, str):
        device = get_device(device)
    elif not isinstance(device, DeviceProfile):
        raise ValueError(f"device must be a DeviceProfile or the name of one (sim.DEVICES), got {device!r}")
    b = spec.batch_size if batch_size is None else batch_size
    try:
        b = operator.index(b) if not isinstance(b, bool) else None  # (numpy integers too; not 2.5)
    except TypeError:
        b = None
    if b is None or b < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    layers = []
    total_params = 0
    for s in spec.shapes():
        nbytes = s.act_elems * b * device.activation_bytes + s.params * device.activation_bytes
        layers.append(Layer(
            name=s.name,
            forward_s=device.layer_time(s.flops * b, nbytes, s.kernels),
            backward_s=device.layer_time(2 * s.flops * b, 2 * nbytes, 2 * s.kernels),
            grad_bytes=s.params * GRAD_BYTES_PER_PARAM,
            params=s.params,
        ))
        total_params += s.params
    return Trace(
        model=spec.name,
        layers=tuple(layers),
        batch_size=b,
        sample_unit=spec.sample_unit,
        optimizer_s=device.layer_time(0, total_params * OPTIMIZER_BYTES_PER_PARAM, 1),
        source=f"models_zoo shapes on {device.name} ({device.precision}, {device.efficiency:.0%} of peak)",
    )
