from tunerd.cli import main

raise SystemExit(main())
