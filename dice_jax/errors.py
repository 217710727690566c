"""The learner's user-error type.

`UserError` is bad input from the person running a command: a file, directory, field, flag or
address that is missing or wrong. Its message names that thing and says what was expected, in
one line. The launchers print it as that one line and exit with status 2, without a traceback
(`experiments/_cli.py`); any other exception is a bug and keeps its traceback.
Subclasses: `data.tasks.DataError`, `data.tokenizer.TokenizerError`, `hf.checkpoint.CheckpointError`,
`hf.safetensors_io.SafetensorsError`, `train.resume.ConfigChangedError`, ...
"""


class UserError(ValueError):
  """Bad user input; the message names the input (file, field, flag, address) in one line."""
