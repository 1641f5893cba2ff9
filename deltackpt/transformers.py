"""Hugging Face transformers through deltackpt: the ``Trainer`` saving deltackpt steps and
resuming from them (:mod:`deltackpt.integrations.hf_trainer`), and a step exported as a model
folder (:mod:`deltackpt.integrations.hf_export`).

Importing it imports ``transformers``, after checking that its version is one deltackpt is
tested with (``pip install 'deltackpt[transformers]'``).
"""

from deltackpt.integrations.hf_export import HFExport, export_hf
from deltackpt.integrations.hf_trainer import CheckpointMixin, Trainer

__all__ = ["CheckpointMixin", "HFExport", "Trainer", "export_hf"]
