"""Witnessing training loops that others wrote: Hugging Face ``Trainer`` (``hf``)."""
