"""Each API's routes and pipelines, one module per endpoint family: a body through its wire format
(``app/wire/``), the model's pipeline (``app/pipeline/``) and the scheduler, to its answer. Torch-free."""
