import sys

from tinyvllm.cli import main

sys.exit(main())
