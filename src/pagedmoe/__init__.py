"""pagedmoe: MoE inference on memory-short GPUs (paged experts, lossless tier, dynamic precision)."""
from pagedmoe.sampling_params import CompletionOutput, RequestOutput, SamplingParams
from pagedmoe.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StructuredOutputsParams",
           "__version__"]


def __getattr__(name):
    # LLM pulls in torch and transformers; import it lazily so `pagedmoe --help` stays fast.
    if name == "LLM":
        from pagedmoe.llm import LLM

        return LLM
    raise AttributeError(name)
