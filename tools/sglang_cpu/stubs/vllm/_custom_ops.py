"""Import-only stand-in: SGLang's rotary embedding imports vLLM's kernel off CUDA; the checks here load weights and
never run a forward."""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError("stub: the SGLang CPU checks load weights only")
