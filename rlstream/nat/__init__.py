"""rlstream as a NeMo Agent Toolkit (NAT) finetuning backend: ``nat finetune`` with rlstream's components.

Install with ``pip install 'rlstream[nat]'``; NAT finds the components through the ``nat.components`` entry
point (:mod:`rlstream.nat.register`). ``_type`` names: ``rlstream_traj_builder``, ``rlstream_trainer_adapter``,
``rlstream_trainer``; docs/nat.md has the recipe.
"""
