"""Python source that makes ``import torch`` fail, for running partita where torch is not installed
(a login node): prepend it to a ``python -c`` program."""

BLOCK_TORCH = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'torch' or name.startswith('torch.'):\n"
               "            raise ImportError('torch blocked')\n"
               "sys.meta_path.insert(0, Block())\n")
