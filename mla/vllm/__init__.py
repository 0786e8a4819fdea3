"""openmla's attention backends for vLLM 0.32, registered through vLLM's plugin entry point
(group `vllm.general_plugins`, `openmla.mla.vllm:register`):

    vllm serve <model> --attention-backend OPENMLA_SPARSE     # sparse MLA (sparse.py)
    vllm serve <model> --attention-backend OPENMLA_ATTN       # MHA/GQA (attn.py)

Importing this package, or its modules, does not import vLLM: the backend classes are built on
first attribute access (common.lazy_classes).
"""

__all__ = ["register"]


def register() -> None:
    """Entry point of the `vllm.general_plugins` group: registers OPENMLA_SPARSE and OPENMLA_ATTN,
    and openmla's DSA indexer in place of vLLM's `SparseAttnIndexer` (indexer.py).

    Registers the class paths only (vLLM imports a class when its backend is selected). Safe to
    call more than once (vLLM may load plugins again): a second call re-points the names."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from openmla.mla.vllm import attn, indexer, sparse
    indexer.register()
    for name, path in ((sparse.BACKEND_NAME, f"{sparse.__name__}.OpenMLASparseBackend"),
                       (attn.BACKEND_NAME, f"{attn.__name__}.OpenMLAAttentionBackend")):
        if name in AttentionBackendEnum.__members__:
            register_backend(AttentionBackendEnum[name], path)
        else:
            register_backend(name, path)
        # vLLM pickles its config (holding the chosen member) into engine processes; a spawned
        # one unpickles it before loading plugins, where an enum member is looked up by value
        # and a registered name is not there yet ("... is not a valid AttentionBackendEnum").
        # Our members unpickle through _backend_member instead, which registers them first.
        AttentionBackendEnum[name].__reduce_ex__ = lambda protocol, n=name: (_backend_member, (n,))


def _backend_member(name: str):
    """The AttentionBackendEnum member `name`, registering openmla's backends if needed."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    if name not in AttentionBackendEnum.__members__:
        register()
    return AttentionBackendEnum[name]
