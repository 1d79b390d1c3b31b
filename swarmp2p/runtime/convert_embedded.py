"""``python -m swarmp2p.runtime.convert_embedded``: convert the embedded model now if it is not
yet, and print ``{"path", "converted", "seconds"}`` as one JSON line (the converted folder).

The command users, the installer and light callers' conversion subprocess run. ``-m`` on the
converting module itself would warn from runpy, since its package imports it first; this
module's package (``swarmp2p.runtime``) imports no framework.
"""

from swarmp2p.runtime.torch.model.embedded import main

if __name__ == "__main__":
    main()
