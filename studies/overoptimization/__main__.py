import sys

from studies.overoptimization.analysis import main

sys.exit(main())
