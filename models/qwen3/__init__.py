"""Qwen3, dense and Mixture-of-Experts: the ``qwen3`` ModelSpec (``spec``), which models/registry.py lists."""

from models.llama3.model import flops_per_token, memory_shapes
from models.qwen3.flavors import qwen3_flavors
from models.qwen3.hf_adapter import Qwen3HFAdapter
from models.qwen3.model import Qwen3ModelArgs, Transformer
from models.qwen3.parallelize import parallelize_qwen3, pipeline_stage
from models.spec import ModelSpec

__all__ = ["Qwen3HFAdapter", "Qwen3ModelArgs", "Transformer", "qwen3_flavors", "spec"]

spec = ModelSpec(
    name="qwen3",
    model_cls=Transformer,
    args_cls=Qwen3ModelArgs,
    flavors=qwen3_flavors,
    flops_per_token=flops_per_token,
    parallelize_fn=parallelize_qwen3,
    pipeline_fn=pipeline_stage,
    shapes=memory_shapes,
    state_dict_adapter=Qwen3HFAdapter,
)
