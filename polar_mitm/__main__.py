from polar_mitm.cli import main

main()
