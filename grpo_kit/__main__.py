import sys

from grpo_kit.app.cli import main

sys.exit(main())
