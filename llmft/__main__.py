import sys

from llmft.cli import main

sys.exit(main())
