"""The online side: :class:`~dali_pipes.loading.loader.DALILoader` and everything only it uses.

A batch's way through it: ``config`` holds the option groups (``RunOptions``,
``DataOptions``), ``options`` fills in what they left unset, ``world`` finds the
rank and device, ``store_setup`` stages and opens the dataset (or the datasets of
a ``mixture``, or ``streaming`` through a bounded shard cache), ``pipeline_build`` wraps the user's spec in a DALI graph fed by the
external source in ``sources`` (``batch_source`` for a batch a call), which reads
this rank's order from ``epoch_plan`` and appends the spec's per-batch inputs (a
scheduled size from ``epoch_size``, mix and erasing draws). ``loader`` asks a
``streams.BatchStream`` (DALI's iterator, or ``direct`` without a graph) for
batches, watched by ``guard``; ``passes`` owns where it stands in its epochs,
``epoch_chain`` which epochs one stream epoch reads, ``state`` the saved form.
``workers``, ``lifetime`` and ``start_method`` look after DALI's worker processes;
``errors`` and ``diagnose`` say what failed, naming the sample.

Nothing is imported here, so that ``dali_pipes.loading.errors`` stays light.
"""
