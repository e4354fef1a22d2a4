"""`python -m crane_mp` is `crane-launch`."""

from crane_mp.launch import main

main()
