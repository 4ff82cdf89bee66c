"""The bottom layer: what every phase of the compiler and the runtime say to each other
(placements and moves, node facts, the rules' options). It imports nothing else of Partita."""
