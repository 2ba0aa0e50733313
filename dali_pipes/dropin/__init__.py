"""Drop-in replacements for the data functions of the scripts people train with.

A training script written for a ``DataLoader`` keeps its own code: only the
functions that make its datasets and loaders come from here, with the same
names, arguments and return values, and build :class:`~dali_pipes.DALILoader`\\ s
over datasets converted by ``dali-pipes convert``:

- :mod:`dali_pipes.dropin.timm_train`: ``create_dataset`` and ``create_loader``
  for timm's ``train.py`` (one import line changed), with timm's class indices
  (:mod:`dali_pipes.dropin.timm_classes`: labels are renumbered only for a dataset
  converted from an image folder, or with a ``class_map``; any other keeps its
  source's numbering) and its training batches per rank;
- :mod:`dali_pipes.dropin.torchvision_reference`: ``load_data`` and ``DataLoader``
  for torchvision's ``references/classification/train.py`` (four lines changed);
- :mod:`dali_pipes.dropin.common`: what both share: the converted split
  (:class:`~dali_pipes.dropin.common.ConvertedSplit`), the sampler a script holds
  before its loader exists, and a ``collate_fn`` applied to whole batches.

Each argument either is honoured or, when its value asks for something the
loader cannot do, refused by name (never silently dropped); arguments about a
``DataLoader``'s own machinery (``num_workers``, ``pin_memory``...) are taken and
left to DALI, which says so in one log line.
"""
