"""Training components a train spec points at: AdamW containers, LR schedules, the loss.

They sit below both ``models/`` (whose ``TrainSpec`` defaults name them) and ``train/``
(whose trainer calls them), so neither of those imports the other to reach them.
"""
