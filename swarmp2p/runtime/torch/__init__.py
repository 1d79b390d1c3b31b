"""The torch stage runtime: imported only by worker processes."""

import torch  # noqa: F401  (this package is the torch plane)
