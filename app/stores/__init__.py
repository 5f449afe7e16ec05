"""What is kept: uploaded files and their uploads, the Batch API's records, the Responses API's stored responses.
Torch-free."""
