"""warmstart: an LLM inference server whose edge is the restart. Public API: LLM, SamplingParams."""
from warmstart.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; importing it lazily keeps `import warmstart` (and the CLI's --help) fast.
    if name == "LLM":
        from warmstart.llm import LLM
        return LLM
    raise AttributeError(name)
