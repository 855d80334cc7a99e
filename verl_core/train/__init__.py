"""The one training engine (:mod:`.engine`) and what it is made of: its settings (:mod:`.config`), which rows
each step reads (:mod:`.batches`), non-finite checks (:mod:`.update_checks`), mixed precision
(:mod:`.precision`), checkpoints and their safetensors + JSON state files (:mod:`.checkpoints`,
:mod:`.state_io`), metric callbacks (:mod:`.callbacks`) and progress output (:mod:`.progress`)."""
