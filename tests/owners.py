"""The tests' owner of each model they build: what the nodes' model cache and the command line's generator are in
the product (graph_runtime/loaded.py). One `LoadedTransformer` per transformer for the whole session, so a LoRA
merged by one test is known (and restored) by the next that uses the same model, as in the product where one
owner holds each loaded model."""

from graph_runtime.loaded import LoadedTransformer

_owners: dict[int, LoadedTransformer] = {}


def loaded_for(transformer) -> LoadedTransformer:
    owner = _owners.get(id(transformer))
    if owner is None or owner.transformer is not transformer:  # an id reused by a new model gets a new owner
        owner = _owners[id(transformer)] = LoadedTransformer(transformer)
    return owner


def forget(transformer) -> None:
    """Drop the owner (and with it the engine, LoRA state and workers) of a model a test is done with."""
    _owners.pop(id(transformer), None)


def forget_all() -> None:
    """Drop every owner: the models they hold are freed once the tests drop theirs too (a test that needs an empty
    GPU calls this first, since an owner keeps its transformer alive)."""
    _owners.clear()


def generator_for(models, **options):
    """A QwenImageGenerator over `models` whose transformer has its one owner (`loaded_for`)."""
    from graph_runtime.generate import QwenImageGenerator

    return QwenImageGenerator(models, loaded=loaded_for(models.transformer), **options)
