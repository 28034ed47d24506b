"""Callbacks that drive a :class:`~bso_client.BatchSizeOptimizer` from a framework's trainer.

Import the submodule of your framework; each imports its framework, this
package does not:

* :mod:`bso_client.integrations.lightning`: ``BsoLightningCallback`` for
  PyTorch Lightning (``pytorch_lightning``).
* :mod:`bso_client.integrations.hf`: ``BsoHfCallback`` for the Hugging Face
  ``transformers`` Trainer.
* :mod:`bso_client.integrations.accelerate`: ``check_accelerator`` for a loop
  driven by Hugging Face Accelerate (no callback: the script calls bso itself).
"""
