"""The VBS paper's Table II, to print beside our own figures, never as ours.

Choudhury, Goyal, Sabharwal and Verma, "Variable batch size across layers for efficient
prediction on CNNs", Table II:
"Throughput gain (max) for networks with varying memory", the percentage reduction of time
per image of their VBS algorithm over the fixed-batch baseline (FBS, the largest uniform batch
that fits), request size 12, PyTorch 0.4.1 with CUDA and cuDNN, memory restricted to 15-40 MB
beside the model. Their MobileNet is v1 (torchvision has v2, which we run); their
"SqueezeNet-v0" is squeezenet1_0.
"""

from __future__ import annotations

CITATION = ("Choudhury et al., \"Variable batch size across layers for efficient prediction on "
            "CNNs\", Table II (request size 12, PyTorch 0.4.1 on CUDA, memory limited to 15-40 MB)")

# model here -> (the paper's network, gain % with memory < 30 MB, gain % with memory > 35 MB)
TABLE_II = {
    "googlenet": ("GoogleNet", 60.25, 36.55),
    "resnet50": ("ResNet50", 38.91, 22.75),
    "squeezenet1_0": ("SqueezeNet-v0", 44.03, 29.50),
    "mobilenet_v2": ("MobileNet-v1", 5.68, 1.61),
}
