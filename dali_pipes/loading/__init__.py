"""The online side: :class:`~dali_pipes.loading.loader.DALILoader` and everything only it uses.

A batch's way through it: ``options`` fills in and checks the arguments,
``world`` finds the rank and device, ``pipeline_build`` wraps the user's spec in
a DALI graph fed by the external source in ``sources`` (``batch_source`` for a
batch a call), which reads this rank's order from ``epoch_plan`` and appends the
spec's per-batch inputs (a scheduled size from ``epoch_size``, mix and erasing
draws); ``loader`` iterates and keeps the position that ``state`` saves. ``workers``,
``lifetime`` and ``start_method`` look after DALI's worker processes;
``errors`` and ``diagnose`` say what failed, naming the sample. ``store_setup`` stages
and opens the dataset, or the datasets of a ``mixture`` joined into one store.

Nothing is imported here, so that ``dali_pipes.loading.errors`` stays light.
"""
