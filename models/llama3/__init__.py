"""Llama 3 / 3.1: the ``llama3`` ModelSpec (``spec``), which models/registry.py lists."""

from models.llama3.flavors import llama3_flavors
from models.llama3.hf_adapter import Llama3HFAdapter
from models.llama3.parallelize import parallelize_llama, pipeline_stage
from models.llama3.model import (Transformer, TransformerModelArgs, count_params, flops_per_token, memory_shapes,
                                 num_params)
from models.spec import ModelSpec

__all__ = [
    "Llama3HFAdapter",
    "Transformer",
    "TransformerModelArgs",
    "llama3_flavors",
    "flops_per_token",
    "num_params",
    "count_params",
]

spec = ModelSpec(
    name="llama3",
    model_cls=Transformer,
    args_cls=TransformerModelArgs,
    flavors=llama3_flavors,
    flops_per_token=flops_per_token,
    parallelize_fn=parallelize_llama,
    pipeline_fn=pipeline_stage,
    shapes=memory_shapes,
    state_dict_adapter=Llama3HFAdapter,
)
