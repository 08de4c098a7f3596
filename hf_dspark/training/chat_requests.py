"""Well-formed chat requests composed from frames and slot lists: chat prompts as a real person would type them.

The drafter learns the target's own answers to its training prompts. For chat those prompts come mostly from Magpie
(the 135M target writes user requests itself), and they are often incoherent ("Prep Dog: Am i safe in there after
3?..."); a drafter trained on answers to them does much worse on hand-written chat requests than on Magpie ones.
This module writes the missing kind: specific, natural requests (advice, explanations, creative writing, plans,
messages, summaries, ...) built as frame × slot values, so a seed yields thousands of distinct ones.

Each kind holds groups of frames whose ``{slot}`` fields draw from the group's own lists (so options that are
compared, or a recipient and the matter written to them, belong together). ``{Slot}`` is the value with a capital
first letter, and ``{slot2}`` a second value of ``slot`` different from the first. Values carry their own article,
so no frame has to choose between "a" and "an". A kind may put a sentence of personal context before the request
and a constraint after it.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .pasted_texts import PARAGRAPHS, SENTENCES
from .prompts import EvalOverlapGuard, Prompt, _normalise

logger = logging.getLogger(__name__)

_FIELD = re.compile(r"\{(\w+)\}")
_CONTEXT_RATE = 0.3  # share of requests opened by a sentence of personal context (when the kind has some)
_CONSTRAINT_RATE = 0.3  # share closed by a constraint ("Keep it under 100 words.")
_MAX_TRIES = 200  # new texts tried for a kind's turn before the kind counts as exhausted


@dataclass(frozen=True)
class _Group:
    """Frames sharing one table of slot lists."""

    frames: tuple[str, ...]
    slots: Mapping[str, Sequence[str]]


@dataclass(frozen=True)
class _Kind:
    """One kind of request (category ``request-<name>``): its groups, and the sentences that may open or close it."""

    name: str
    groups: tuple[_Group, ...]
    contexts: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()


def _group(frames: Sequence[str], **slots: Sequence[str]) -> _Group:
    return _Group(tuple(frames), slots)


def _fill(frame: str, slots: Mapping[str, Sequence[str]], rng: random.Random) -> str:
    """The frame with every field replaced; fields of one base name get distinct values."""
    names_of: dict[str, list[str]] = {}
    for name in dict.fromkeys(_FIELD.findall(frame)):
        names_of.setdefault(name.lower().rstrip("0123456789"), []).append(name)
    values = {}
    for base, names in names_of.items():
        for name, value in zip(names, rng.sample(list(slots[base]), len(names))):
            values[name] = value[0].upper() + value[1:] if name[0].isupper() else value
    return _FIELD.sub(lambda m: values[m.group(1)], frame)


def _compose(kind: _Kind, rng: random.Random) -> str:
    group = rng.choice(kind.groups)
    text = _fill(rng.choice(group.frames), group.slots, rng)
    if kind.contexts and rng.random() < _CONTEXT_RATE:
        text = f"{rng.choice(kind.contexts)} {text}"
    if kind.constraints and rng.random() < _CONSTRAINT_RATE:
        text = f"{text} {rng.choice(kind.constraints)}"
    return text


# ---------------------------------------------------------------------------------------------------------
# The kinds of request
# ---------------------------------------------------------------------------------------------------------

_ADVICE = _Kind("advice", (
    _group(["{Situation}. {ask}", "I need some advice: {situation}. {ask}",
            "{Situation}, and I'm not sure what to do. {ask}",
            "What's the best way to deal with this? {Situation}.",
            "{Situation}, and it's starting to really bother me. {ask}",
            "Can I get your take on something? {Situation}. {ask}"],
           situation=[
               "my in-laws drop by without warning almost every weekend",
               "my sister keeps borrowing money and never pays it back",
               "a colleague takes credit for my work in meetings",
               "my best friend cancels our plans at the last minute almost every time",
               "my roommate never does the dishes",
               "my parents want me to move back home after university",
               "my manager messages me on weekends and expects quick replies",
               "my neighbour's dog barks all day while they're at work",
               "my brother-in-law makes political jokes at every family dinner",
               "I lent my car to a friend and it came back with a dent",
               "my teenage son stays up gaming until three most nights",
               "a coworker keeps eating my lunch from the office fridge",
               "my letting agent still hasn't fixed the heating after three weeks",
               "my partner wants to move to another city for a job", "my friends keep making plans without me",
               "my elderly father refuses to stop driving even though his eyesight is getting worse",
               "my roommate's boyfriend practically lives with us but pays nothing",
               "I owe a friend $400 and can't pay it back this month",
               "my mother-in-law rearranges my kitchen every time she visits",
               "a neighbour parks across my driveway most mornings",
               "the coworker next to me takes loud phone calls all day",
               "my friend asked me to be a bridesmaid, but I can't afford the dress and the trip",
               "my two kids fight every single time we get in the car",
               "my boss asked me to train a new hire and I suspect they're replacing me",
               "I was offered a great job across the country, but my whole family lives here",
               "my flatmate keeps turning the heating up and our bill has doubled",
               "a close friend told me a secret that affects another friend",
               "my cousins are upset that my grandmother wants to leave her house to me",
               "my new coworker asks me for help with everything",
               "my best friend is dating someone I really don't trust",
               "my dad keeps sending me job listings even though I'm happy where I am",
               "my in-laws expect us to spend every holiday with them"],
           ask=["How do I raise it without making things awkward?", "What would you do in my place?",
                "How do I talk to them about it calmly?", "Should I say something, or just let it go?",
                "What are my options here?", "How can I set a boundary without damaging the relationship?",
                "What's a fair way to handle this?", "Can you help me figure out what to say?"]),
), contexts=("I tend to avoid conflict.", "I've been stewing on this for weeks.",
             "I'm usually pretty easygoing, but this is getting to me.",
             "English is my second language, so please keep your answer simple.",
             "I'm 24 and still figuring out how to deal with this kind of thing."),
   constraints=("Please keep it short.", "A few bullet points would be great.",
                "Be honest, even if I'm the one in the wrong.", "Give me two or three options to choose from."))

_EXPLAIN = _Kind("explain", (
    _group(["Can you explain why {clause}?", "I've always wondered why {clause}. What's the reason?",
            "What's the science behind why {clause}?", "Why is it that {clause}?",
            "Someone asked me why {clause}, and I had no idea. How would you explain it?",
            "Explain why {clause} in a way a ten-year-old would understand.",
            "Is there a simple explanation for why {clause}?"],
           clause=["the sky is blue", "ice floats on water", "chopping onions makes us cry",
                   "metal feels colder than wood at the same temperature",
                   "our ears pop on a plane", "cats purr", "leaves change colour in autumn",
                   "the moon looks bigger near the horizon", "metal feels colder than wood in the same room",
                   "soap removes grease", "we get goosebumps", "popcorn pops", "a straw in a glass of water looks bent",
                   "salt melts ice on roads", "yawning is contagious", "soap bubbles are round", "the sea is salty",
                   "coffee keeps people awake", "some people get carsick and others don't", "a boomerang comes back",
                   "stars twinkle", "a cut apple turns brown", "we hear thunder after we see lightning",
                   "our fingers wrinkle in the bath", "a fridge hums", "hot air rises", "the moon has phases",
                   "rubber bands snap back", "planes leave white trails in the sky", "we have leap years",
                   "our own voice sounds strange on recordings", "dogs wag their tails", "frost forms on car windows",
                   "glass is see-through", "we get hiccups", "the sun looks orange at sunset",
                   "we feel dizzy after spinning around", "ice cubes crack when you drop them in a drink",
                   "old paper turns yellow", "some people are left-handed", "the ocean has waves"]),
    _group(["How does {thing} work?", "Can you explain how {thing} works?",
            "How does {thing} actually work, in simple terms?", "Walk me through how {thing} works, step by step.",
            "I'm curious about {thing}. How does it work?", "What's the basic idea behind {thing}?"],
           thing=["a microwave oven", "a refrigerator", "a smoke detector", "a vaccine", "GPS on a phone",
                  "a touchscreen", "a heat pump", "an induction hob", "a credit score", "a solar panel",
                  "a bicycle's gears", "a thermostat", "an electric car battery", "a compass", "a smoke detector",
                  "the immune system", "a hydroelectric dam", "Wi-Fi", "a pressure cooker", "a QR code",
                  "compound interest", "a hot-air balloon", "a camera lens", "a dishwasher", "a door lock",
                  "an elevator", "a fountain pen", "a wind turbine", "a barcode scanner", "a submarine",
                  "the human ear", "a sewing machine",
                  "a 3D printer", "an X-ray machine", "contactless card payment", "an air conditioner",
                  "a mechanical watch", "a fire extinguisher", "a search engine", "a pacemaker"]),
), contexts=("I'm a high school student studying for a test.", "I never took science after school.",
             "I'm a curious retiree with plenty of time on my hands.", "My kids keep asking me about this.",
             "I'm a night-shift nurse and this came up during a quiet hour at work."),
   constraints=("Keep it under 100 words.", "Explain it as if I'm ten years old.", "Please skip the maths.",
                "Use an everyday analogy.", "One paragraph is enough."))

_SUBJECTS = ["a goat who wants to be a sheepdog", "my grandmother's garden",
             "a night-bus driver's last shift before retiring",
             "the first snow of winter", "a robot learning to bake bread", "an umbrella left behind on a train",
             "Monday mornings", "a dog waiting at the door for its owner", "my best friend moving to Canada",
             "a small flower shop on a busy street", "an old bicycle in a garden shed", "the smell of rain in summer",
             "a goldfish who dreams of the ocean", "a school bus driver on her last day before retiring",
             "a city just before sunrise", "a chess match between two grandfathers", "a broken vending machine",
             "the last day of summer camp", "a kid's first day at a new school", "a houseplant that refuses to die",
             "a pigeon who runs a newspaper stand", "my coffee maker breaking on a Monday",
             "a tired marathon runner at mile twenty", "a fox in a snowy forest",
             "two old friends meeting after twenty years", "a night bus full of strangers", "a lost mitten",
             "a dragon who is scared of heights", "the view from a hospital window", "moving into a first flat"]
_CREATIVE = _Kind("creative", (
    _group(["Write {form} about {subject}.", "Could you write {form} about {subject}?",
            "I need {form} about {subject} for {audience}.", "Write {form} about {subject}, in the style of {style}.",
            "Can you come up with {form} about {subject}?"],
           form=["a limerick", "a haiku", "a short poem", "a four-line rhyme", "a short story",
                 "a sonnet", "a bedtime story", "a fable", "a free-verse poem",
                 "a very short story in exactly six sentences", "an acrostic poem"],
           subject=_SUBJECTS,
           audience=["my daughter's class", "a birthday card", "our office newsletter", "a poetry night at the library",
                     "my grandmother", "a school assembly", "my writing group"],
           style=["a nature documentary", "a sports commentator", "an old fairy tale", "a detective novel",
                  "a weather report", "a Shakespeare play"]),
    _group(["Write a verse for {song} about {subject}.", "Can you write the chorus of {song} about {subject}?"],
           song=["a country song", "a folk song", "a pop song", "a blues song", "a lullaby", "a sea shanty",
                 "an indie rock song", "a punk song", "a children's song"],
           subject=_SUBJECTS),
    _group(["Write a riddle whose answer is {answer}.", "Can you make up a riddle where the answer is {answer}?",
            "Write a rhyming riddle for kids. The answer should be {answer}."],
           answer=["a shadow", "an echo", "a candle", "a map", "a key", "a clock", "a towel", "a mirror", "an egg",
                   "a footstep", "a sponge", "a violin", "a river", "a secret", "a pencil", "a cloud", "an umbrella"]),
    _group(["Write a short toast for {occasion}.", "I have to give a toast at {occasion}. Can you write something "
            "warm and a little funny that takes about a minute to say?",
            "Help me write a few sentences to say at {occasion}."],
           occasion=["my sister's wedding", "my parents' 40th anniversary", "a coworker's retirement party",
                     "my best friend's 30th birthday", "a dinner for a team that just finished a big project",
                     "my grandfather's 90th birthday", "a goodbye party for a friend who is moving abroad",
                     "our neighbourhood's summer barbecue", "my brother's graduation dinner",
                     "the opening of a friend's café"]),
), constraints=("Keep it under 100 words.", "Make it funny.", "Make it a little sad.", "Give it a title.",
                "Keep the language simple enough for a seven-year-old.", "Don't make it too cheesy."))


def _compare(options: Sequence[str], purposes: Sequence[str]) -> _Group:
    return _group(["What's the difference between {option} and {option2} for {purpose}?",
                   "{Option} or {option2}: which is better for {purpose}?",
                   "I'm trying to choose between {option} and {option2} for {purpose}. What would you pick and why?",
                   "Compare {option} and {option2} for {purpose}. What are the main pros and cons of each?",
                   "Which makes more sense for {purpose}, {option} or {option2}?",
                   "Would {option} really be better than {option2} for {purpose}?"],
                  option=options, purpose=purposes)


_COMPARE = _Kind("compare", (
    _compare(["a French press", "a pour-over cone", "a drip coffee maker", "an espresso machine", "a capsule machine"],
             ["making one cup before work", "making coffee for four people at weekends",
              "a tiny kitchen with almost no counter space", "someone on a tight budget"]),
    _compare(["a bicycle", "an e-scooter", "a used car", "a monthly bus pass", "an e-bike"],
             ["a 10 km commute in a rainy city", "getting around a hilly town", "a student budget",
              "short trips to the shops"]),
    _compare(["a language app", "evening classes", "a private tutor", "a language exchange partner",
              "watching TV shows with subtitles"],
             ["learning Spanish before a trip in six months", "passing a B1 exam in German",
              "someone who works long hours", "an adult beginner learning Japanese"]),
    _compare(["a tablet", "a Chromebook", "a mid-range Windows laptop", "a MacBook Air", "a desktop PC"],
             ["a university student who writes a lot of essays", "a grandparent who mostly video calls family",
              "light photo editing", "working from cafés"]),
    _compare(["an air fryer", "a slow cooker", "a pressure cooker", "a microwave", "a toaster oven"],
             ["cooking for one after long shifts", "a family of five", "a student dorm",
              "batch cooking on Sundays"]),
    _compare(["running", "swimming", "cycling", "yoga", "weight training", "rowing"],
             ["losing weight with bad knees", "building strength after 50", "reducing stress",
              "someone with only 30 minutes a day"]),
    _compare(["a high-yield savings account", "an index fund", "a fixed-term deposit", "a money market fund"],
             ["money I might need in two years", "saving for a house deposit", "an emergency fund",
              "my kids' university savings"]),
    _compare(["a cat", "a dog", "a rabbit", "a pair of guinea pigs", "a budgie"],
             ["a small flat with no garden", "a family with young kids",
              "someone who travels for work twice a month", "a first pet for a nine-year-old"]),
    _compare(["renting a flat in the city centre", "buying a small house in the suburbs",
              "sharing a house with friends", "living with my parents for another year"],
             ["a couple in their late twenties", "someone starting their first job",
              "saving as much as possible", "a person who hates long commutes"]),
    _compare(["taking the train", "flying", "driving", "taking an overnight bus"],
             ["a trip from London to Edinburgh with two kids", "a weekend from Paris to Amsterdam",
              "someone who gets travel sick", "a trip on the cheapest possible budget"]),
    _compare(["paper notebooks", "a notes app on my phone", "index cards", "a tablet with a stylus"],
             ["taking notes in university lectures", "revising for exams", "planning a novel",
              "keeping track of work tasks"]),
    _compare(["a gas barbecue", "a charcoal grill", "an electric grill", "a fire pit with a grate"],
             ["a balcony in a block of flats", "cooking for big summer parties", "someone who grills twice a year"]),
    _compare(["Python", "JavaScript", "Scratch", "Excel formulas"],
             ["a complete beginner who wants to automate office work", "a twelve-year-old who likes games",
              "someone hoping to switch careers into tech"]),
), contexts=("I'm not in a hurry, so I want to get this right.", "I've read a lot of reviews and I'm more confused "
             "than before.", "Money is a bit tight this year."),
   constraints=("A short table would be helpful.", "Keep it brief.", "Finish with a clear recommendation."))

_HOWTO = _Kind("howto", (
    _group(["How do I {task}?", "What's the easiest way to {task}?",
            "Can you give me step-by-step instructions to {task}?",
            "I've never done this before. How do I {task}?", "What do I need to {task}, and how do I go about it?",
            "I tried to {task} last weekend and it went badly. How should I actually do it?",
            "Any tips on how to {task}?", "What's the right way to {task}?"],
           task=["get a red wine stain out of a white carpet", "unclog a bathroom sink without chemicals",
                 "fix a squeaky door hinge", "make fluffy pancakes from scratch", "cook rice so it isn't mushy",
                 "clean a cast-iron pan", "patch a small hole in a plaster wall", "fix a flat tyre on my bike",
                 "descale a kettle", "make a simple tomato sauce", "remove rust from garden tools",
                 "sharpen a kitchen knife", "get rid of fruit flies in the kitchen", "fix a toilet that keeps running",
                 "repot a root-bound houseplant", "bake bread without a bread machine", "iron a shirt without creases",
                 "hang a heavy mirror on a plaster wall", "clean the filter in my dishwasher", "bleed a radiator",
                 "make cold brew coffee at home", "get chewing gum out of hair", "grow basil on a windowsill",
                 "reseal around a bathtub", "roast a whole chicken", "boil an egg so the yolk stays soft",
                 "sew a button back onto a coat", "clean mould off a shower curtain", "fold a fitted sheet",
                 "defrost a freezer quickly", "fix a zip that has come off one side", "keep fresh herbs from wilting",
                 "get the smell of smoke out of a sofa", "make a basic vegetable soup",
                 "paint a room without making a mess", "clean a smelly washing machine",
                 "make a compost heap in a small garden", "tighten a wobbly table leg", "poach an egg",
                 "clean the grout between bathroom tiles", "make guacamole", "season a new wok",
                 "wash a wool jumper without shrinking it", "get candle wax off a tablecloth", "put up a shelf",
                 "make overnight oats", "clean windows without leaving streaks", "unclog a shower head",
                 "make pizza dough at home", "keep cut flowers fresh for longer", "fix a dripping tap",
                 "prune a rose bush", "teach a puppy to sit", "bake chewy chocolate chip cookies",
                 "get rid of a musty smell in a wardrobe", "cook dried chickpeas"]),
), contexts=("I'm a complete beginner.", "I only have basic tools at home.", "I live in a small flat.",
             "I'm on a tight budget.", "I just moved into my first place on my own."),
   constraints=("Keep it to five steps or fewer.", "Please use numbered steps.", "I don't have much time, so keep it "
                "brief.", "Tell me what mistakes to avoid, too."))

_HISTORY = _Kind("history", (
    _group(["Can you tell me about {event}?", "What led to {event}, and what happened afterwards?",
            "Why does {event} still matter today?", "Give me a short overview of {event}.",
            "What are some surprising facts about {event}?", "How did {event} change everyday life for people?"],
           event=["the fall of the Berlin Wall", "the building of the Panama Canal", "the first Moon landing",
                  "the Black Death", "the building of the Great Wall of China", "the French Revolution",
                  "the Silk Road", "the Great Fire of London", "the discovery of penicillin",
                  "the Meiji Restoration in Japan", "the building of the pyramids at Giza", "the Apollo 13 mission",
                  "the Dust Bowl of the 1930s", "the end of apartheid in South Africa",
                  "the Viking settlement of Iceland", "the California Gold Rush", "the first modern Olympic Games",
                  "the Wright brothers' first flight", "the Renaissance in Florence",
                  "the opening of the first public railway", "the eruption of Vesuvius that buried Pompeii",
                  "the Irish potato famine", "the invention of the printing press", "the invention of the telephone",
                  "the invention of paper money in China", "the spread of coffee houses in Europe",
                  "the sinking of the Titanic", "the building of the Eiffel Tower", "the Cuban Missile Crisis",
                  "the fight for women's right to vote in Britain", "the invention of the bicycle",
                  "the first transatlantic telegraph cable", "the rise of the Inca Empire"]),
    _group(["What is {person} best known for?", "Tell me about the life of {person}.",
            "Why does {person} still matter today?", "What did {person} achieve, and what obstacles stood in the way?",
            "Who was {person}?"],
           person=["Ada Lovelace", "Ibn Battuta", "Marie Curie", "Nikola Tesla", "Frida Kahlo", "Genghis Khan",
                   "Harriet Tubman", "Leonardo da Vinci", "Mansa Musa", "Hokusai", "Florence Nightingale",
                   "Galileo Galilei", "Cleopatra", "Charles Darwin", "Wangari Maathai", "Rosalind Franklin",
                   "Confucius", "Amelia Earhart", "Johannes Gutenberg", "Zheng He", "Hypatia", "Louis Braille",
                   "Isaac Newton", "Jane Austen", "Alan Turing", "Simón Bolívar", "Queen Victoria", "Ibn Sina"]),
    _group(["Where does the custom of {custom} come from?", "What's the history behind {custom}?",
            "Why do people {custom_verb}?"],
           custom=["throwing rice at weddings", "carving pumpkins at Halloween", "giving eggs at Easter",
                   "blowing out candles on a birthday cake", "shaking hands", "brides wearing white",
                   "tipping in restaurants", "saying \"bless you\" after a sneeze", "decorating a tree at Christmas",
                   "playing pranks on April Fools' Day", "eating twelve grapes at midnight on New Year's Eve",
                   "bowing as a greeting in Japan", "drinking afternoon tea in Britain"],
           custom_verb=["knock on wood for luck", "clink glasses before drinking", "make a wish on a wishbone",
                        "give flowers at funerals", "wear black to mourn", "cross their fingers for luck"]),
    _group(["What is {place} famous for, historically?", "How did {place} get its name?",
            "What's the short version of the history of {place}?",
            "What history should I know before visiting {place}?"],
           place=["Rio de Janeiro", "Iceland", "Manhattan", "Singapore", "the Sahara", "Buenos Aires", "Venice",
                  "Timbuktu", "Kyoto", "Machu Picchu", "Petra", "Angkor Wat", "Samarkand", "Stonehenge",
                  "Hadrian's Wall", "the Alhambra", "Zanzibar", "Quebec City"]),
), contexts=("I'm a history teacher planning a lesson.", "I'm studying for a quiz night.",
             "I've been reading about this lately.", "My son has a school project on this."),
   constraints=("Keep it under 150 words.", "Please keep it simple.", "Include a couple of dates."))

_REWRITE = _Kind("rewrite", (
    _group(["Rewrite this sentence to make it {adj}: \"{sentence}\"", "Can you make this sound {adj}? \"{sentence}\"",
            "\"{sentence}\" Please rewrite this so it sounds {adj}.",
            "How would you say this in a {tone} way? \"{sentence}\"",
            "Give me three different ways to say this: \"{sentence}\"", "Rewrite \"{sentence}\" as {format}.",
            "Fix the grammar and make this sound more natural: \"{sentence}\"",
            "I wrote \"{sentence}\" but it sounds off. Can you make it {adj}?"],
           sentence=SENTENCES,
           adj=["more polite", "more formal", "friendlier", "more casual", "more confident", "shorter", "warmer",
                "more direct", "clearer", "more enthusiastic", "funnier", "more professional"],
           tone=["polite", "formal", "friendly", "casual", "professional", "humorous", "gentle", "cheerful",
                 "diplomatic", "tactful"],
           format=["a text message to a friend", "a line in a formal letter", "a social media post",
                   "a notice for an office noticeboard", "something a pirate would say",
                   "a headline in a local newspaper"]),
), constraints=("Keep it under 30 words.", "Give me two versions.", "Keep the meaning the same."))

_PLAN = _Kind("plan", (
    _group(["Plan a {days} trip to {city} for {travellers}.", "Can you put together a {days} itinerary in {city} "
            "for {travellers}?", "I'm going to {city} soon. What would a good {days} plan look like for {travellers}?"],
           days=["two-day", "three-day", "four-day", "five-day", "one-day"],
           city=["Seville", "Kyoto", "Edinburgh", "Mexico City", "Rome", "Vancouver", "Istanbul", "Copenhagen",
                 "Marrakech", "Seoul", "Buenos Aires", "Prague", "Cape Town", "Chicago", "Hanoi", "Vienna", "Barcelona",
                 "Melbourne"],
           travellers=["a couple who love food", "a family with two young kids", "a solo traveller on a tight budget",
                       "two friends who love street food", "my parents, who are in their seventies",
                       "a student who wants to see museums", "someone who hates crowds"]),
    _group(["Help me plan {party} for {guests}.", "I'm hosting {party} for {guests}. How should I organise it?",
            "What do I need to think about when planning {party} for {guests}?"],
           party=["a tenth birthday party", "a surprise 40th birthday party", "a small dinner party", "a baby shower",
                  "a garden barbecue", "a graduation party", "a board game night", "a retirement lunch",
                  "a Halloween party", "a New Year's Eve party", "a picnic in the park"],
           guests=["about 12 people", "20 guests", "six close friends", "about 30 people", "my whole extended family",
                   "a mix of friends and neighbours"]),
    _group(["Make me a weekly dinner plan for {eaters}. {diet}", "Can you plan a week of meals for {eaters}? {diet}",
            "I need a simple meal plan for the week for {eaters}. {diet}"],
           eaters=["a family of four", "one person who only cooks on Sundays", "two adults training for a marathon",
                   "a student with a tiny kitchen", "a couple who both work late", "a family with a fussy toddler"],
           diet=["It has to be vegetarian.", "There can't be any dairy.", "The whole week should cost under $60.",
                 "Each dinner should take under 30 minutes to cook.", "It should include plenty of protein.",
                 "Lunches need to be easy to pack for work."]),
    _group(["I have {weeks} to prepare for {exam}. Can you make me a study plan? {study}",
            "Make a study schedule for {exam}. I have {weeks} left. {study}"],
           weeks=["three weeks", "two months", "six weeks", "ten days", "a month"],
           exam=["my driving theory test", "a first-year calculus exam", "the GRE", "a Spanish B1 exam",
                 "a biology final", "a chemistry resit", "a history essay exam", "a professional accounting exam"],
           study=["I can study about an hour each evening.", "I work full time, so only weekends are free.",
                  "I tend to procrastinate, so build in small goals.", "I learn best with practice questions."]),
    _group(["Help me make a monthly budget. I take home {income} a month and my rent is {rent}. "
            "I'd like to save for {goal}.",
            "Can you help me split {income} a month into a sensible budget? Rent is {rent}, and I'm saving for "
            "{goal}."],
           income=["$2,400", "$3,100", "$2,800", "$4,200", "$3,600"],
           rent=["$900", "$1,100", "$750", "$1,200", "$650"],
           goal=["a holiday next summer", "a used car", "an emergency fund", "a wedding in two years",
                 "a new laptop", "a house deposit"]),
), constraints=("Keep it realistic.", "Please use a simple table.", "Keep it short; I just need an outline."))

_RECIPIENTS = {
    "the letting agent": ["asking them to fix the leaking kitchen tap", "asking whether the rent will go up next year",
                          "explaining that the rent will be three days late"],
    "my son's teacher": ["explaining why he missed school on Friday", "asking for a meeting about his homework"],
    "my neighbour": ["asking them to trim the hedge that blocks the footpath",
                     "inviting them to a small barbecue on Saturday", "apologising for the noise at my party"],
    "my manager": ["asking for Friday off", "asking for a raise after two years in the role",
                   "saying I'll be late because my train was cancelled"],
    "a client": ["explaining that their order will be a week late", "thanking them for their business this year"],
    "my team": ["announcing that I'm leaving the company", "reminding everyone about Friday's deadline"],
    "an old friend I haven't spoken to in years": ["saying I'd love to catch up"],
    "the hotel": ["asking for an early check-in"], "a plumber": ["asking for a quote to replace our boiler"],
    "my gym": ["cancelling my membership"], "my dentist": ["moving my appointment next Tuesday"],
    "a recruiter": ["politely turning down a job offer"], "my book club": ["suggesting the next book we read"],
    "my sister": ["apologising for missing her birthday dinner", "asking if she can look after my cat next weekend"],
    "the school office": ["letting them know my daughter has a dentist appointment on Monday morning"],
    "a seller on a marketplace app": ["asking whether the bike is still available and if the price is negotiable"],
    "my coworkers": ["inviting everyone to leaving drinks on Friday", "asking who took my stapler"],
}
_MESSAGE = _Kind("message", tuple(
    _group(["Write {msg} to {recipient} {matter}.", "Can you help me write {msg} to {recipient} {matter}?",
            "Draft {msg} to {recipient} {matter}. {tone}",
            "I need to send {msg} to {recipient} {matter}. What should I say?"],
           msg=["a short email", "a quick text message", "a polite note", "a brief message", "a friendly email",
                "a short letter"],
           recipient=[recipient], matter=matters,
           tone=["Keep it friendly and natural.", "It shouldn't sound too formal.",
                 "Keep it to three or four sentences.", "I don't want to sound rude."])
    for recipient, matters in _RECIPIENTS.items()),
    contexts=("I'm bad at writing these.", "English isn't my first language.", "I've been putting this off all week."))

_SUMMARY = _Kind("summary", (
    _group(["Summarise this paragraph in one sentence:\n\n{paragraph}",
            "Can you summarize this in {length}?\n\n{paragraph}",
            "{paragraph}\n\nSummarise the text above in {length}.",
            "What's the main point of this paragraph?\n\n{paragraph}",
            "I don't have time to read this properly. What does it say?\n\n{paragraph}",
            "Give me the key points of this text as a short list:\n\n{paragraph}",
            "Here's something I was reading. Summarise it for {reader}:\n\n{paragraph}",
            "TL;DR, please:\n\n{paragraph}", "I'm in a bit of a rush. What does this say, in {length}?\n\n{paragraph}",
            "{paragraph}\n\nCan you boil that down for {reader}?"],
           paragraph=PARAGRAPHS,
           length=["one sentence", "two sentences", "three bullet points", "under 30 words", "plain language",
                   "a single short line"],
           reader=["a busy manager", "my grandmother", "a ten-year-old", "someone who only has ten seconds",
                   "a friend who doesn't speak much English"]),
))

_IDEAS_FRAMES = ["Give me {n} {thing} for {target}.", "Can you suggest {n} {thing} for {target}?",
                 "I need some {thing} for {target}. Any suggestions?",
                 "List {n} {thing} for {target}, with a line on each.", "Brainstorm {thing} for {target}."]
_IDEAS_COUNTS = ["five", "ten", "seven", "three", "a few", "twenty"]
_IDEA_TARGETS = {
    "gift ideas": ["my dad, who loves fishing", "a coworker who is leaving, under $20",
                   "a ten-year-old who likes science",
                   "my grandmother, who says she has everything", "a friend who just moved into her first flat",
                   "a new dad", "my partner's parents, who I'm meeting for the first time"],
    "names": ["a bike repair shop", "a grey rescue cat", "a podcast about gardening",
              "a pub quiz team", "a bookshop with a café", "a black Labrador puppy", "a handmade candle business"],
    "activities": ["a rainy Saturday with two kids", "a team-building afternoon", "a first date that isn't dinner",
                   "a weekend with no money to spend", "a family reunion in a park", "a long train journey"],
    "dinner ideas": ["cheap weeknights", "using up leftover rice", "a picky six-year-old", "a hot summer evening",
                     "a romantic night in", "someone who just started eating vegan"],
    "book recommendations": ["someone who loved The Hobbit", "a long flight", "a teenager who says reading is boring",
                             "a book club that wants something short", "someone grieving a parent"],
    "conversation starters": ["a networking event", "a first date", "meeting my partner's parents",
                              "a dinner party where nobody knows each other"],
    "blog post ideas": ["a blog about budget travel", "a small plant nursery's website", "a cycling club's website"],
    "hobby ideas": ["a retiree who wants to meet people", "someone who works from home and needs to get out more",
                    "a teenager who is always on their phone", "an evening routine without screens"],
    "fundraising ideas": ["a primary school's new playground", "a local animal shelter", "a youth football club"],
    "ice-breaker games": ["a class of new students", "a team meeting on a Monday morning", "a kids' birthday party"],
}
_IDEAS = _Kind("ideas", tuple(_group(_IDEAS_FRAMES, n=_IDEAS_COUNTS, thing=[thing], target=targets)
                              for thing, targets in _IDEA_TARGETS.items()),
               contexts=("I'm terrible at this kind of thing.", "I've run out of ideas.", "I have about a week."))

_OPINION = _Kind("opinion", (
    _group(["What are the pros and cons of {decision}?", "I'm seriously thinking about {decision}. What am I not "
            "considering?", "Is {decision} a good idea? I'd like an honest opinion.",
            "What do you think about {decision}?", "Make the strongest case for and against {decision}.",
            "My friends think {decision} is a mistake. What are the real risks and upsides?"],
           decision=["quitting my stable job to open a bookshop", "moving to a smaller town",
                     "going back to university at 35", "buying an electric car",
                     "getting a dog while working full time", "renting instead of buying a house",
                     "taking a gap year before college", "asking for a four-day work week", "homeschooling my kids",
                     "selling my car and cycling everywhere",
                     "moving in with my partner after six months", "learning to code at 40", "living abroad for a year",
                     "taking out a loan for a master's degree", "buying a house with a friend",
                     "working from home full time", "joining a startup instead of a big company",
                     "deleting my social media accounts", "moving closer to my parents",
                     "switching to night shifts for the extra pay"]),
    _group(["Do you think {claim}? Why or why not?", "Some people argue that {claim}. What are the best arguments on "
            "each side?", "Would you agree that {claim}?"],
           claim=["homework should be banned in primary schools", "public transport in cities should be free",
                  "everyone should learn to cook before leaving home", "remote work is better for most office jobs",
                  "tipping should be replaced by higher wages", "every child should learn a musical instrument",
                  "phones should be banned in classrooms", "everyone should learn first aid",
                  "it's better to rent than to buy a home", "people should retire later",
                  "children should start school later", "cars should be banned from city centres",
                  "shops should close on Sundays", "school uniforms are a good idea", "zoos do more good than harm",
                  "everyone should do a year of community service"]),
), contexts=("I've been going back and forth on this for months.", "My family is split on it.",
             "I tend to be cautious with big decisions."),
   constraints=("Please give me both sides.", "Keep it to a short list.", "Be blunt."))

_CAREER = _Kind("career", (
    _group(["How can I get better at {skill}?", "What's the fastest way to improve at {skill}?",
            "I've been trying to get better at {skill} for a while, but I'm stuck. What should I change?"],
           skill=["public speaking", "writing clear emails", "chess", "mental arithmetic", "drawing faces",
                  "negotiating my salary", "managing my time", "speaking Spanish", "drawing portraits",
                  "reading sheet music", "touch typing", "giving feedback to my team", "Excel",
                  "taking notes in lectures", "remembering what I read",
                  "cooking without recipes", "writing cover letters", "leading meetings", "saying no at work",
                  "explaining technical things to non-experts", "networking", "sketching buildings"]),
    _group(["I'm {job} and I want to move into {field}. Where should I start?",
            "I've worked as {job} for years. How realistic is a switch to {field}, and what would the first steps be?"],
           job=["a primary school teacher", "an accountant", "a retail manager", "a nurse", "a bartender",
                "an electrician", "a graphic designer", "a warehouse worker", "a journalist", "a lab technician",
                "a chef", "a bank clerk"],
           field=["UX design", "data analysis", "project management", "web development", "marketing",
                  "cybersecurity", "social work", "carpentry", "human resources"]),
    _group(["What should I learn first if I want to become {role}?", "What does a typical day look like for {role}?"],
           role=["a data analyst", "an electrician", "a web developer", "a translator", "a physiotherapist", "a pilot",
                 "a pastry chef", "a product manager", "an architect", "a park ranger", "a vet nurse"]),
    _group(["How do I prepare for {interview}?", "I have {interview} next week. What questions should I expect?"],
           interview=["a job interview at a big tech company", "my first teaching job interview",
                      "a panel interview for a hospital job", "an interview for a part-time job at a bookshop",
                      "a video interview with a recruiter", "a group interview at a supermarket",
                      "an internal interview for a promotion"]),
    _group(["What's a good way to learn {subject} on my own?", "How long would it take to learn {subject} well "
            "enough to use it at work?"],
           subject=["statistics", "Italian", "the basics of accounting", "Python", "photography", "sign language",
                    "bookkeeping", "SQL", "basic web design",
                    "Mandarin", "project management", "video editing", "Portuguese"]),
    _group(["How do I ask my boss for {request}?", "What's the best way to ask for {request} without sounding "
            "ungrateful?"],
           request=["a raise", "more flexible hours", "a promotion", "time off to study", "a move to another team",
                    "honest feedback on my work"]),
), contexts=("I'm 38 and feel stuck in my job.", "I'm in my late twenties.", "I only have evenings free.",
             "I'm a night-shift nurse, so my schedule is unusual."),
   constraints=("Keep it practical.", "A short step-by-step plan would be great.", "Please be realistic."))

_HEALTH = _Kind("health", (
    _group(["How can I {goal}?", "What are some realistic ways to {goal}?", "I've tried to {goal} before, but it never "
            "sticks. Any tips that actually work?", "I want to {goal}. Can you give me a simple plan for the next two "
            "weeks?", "What does the evidence say about how to {goal}?",
            "Give me five practical tips to {goal}. Nothing that needs a gym membership, please."],
           goal=["fall asleep faster", "drink more water during the day", "stop snacking late at night",
                 "build a habit of walking after dinner", "cut down on coffee without getting headaches",
                 "stay active while working from home", "spend less time on my phone before bed",
                 "get back into running after a long break", "eat more vegetables", "wake up earlier without "
                 "feeling tired", "reduce back stiffness from sitting all day", "keep a regular sleep schedule at "
                 "weekends", "stop biting my nails", "fit exercise into a busy week", "cook healthier lunches for work",
                 "manage stress before exams", "keep walking regularly through the winter", "cut down on sugar",
                 "stop hitting snooze every morning", "drink less alcohol at weekends", "eat breakfast more often",
                 "get more sunlight in the winter months", "improve my posture at the computer",
                 "take proper breaks during long shifts", "build up to running 5 km", "stop eating lunch at my desk",
                 "unwind after work without the TV"]),
    _group(["Is it true that {claim}?", "I keep hearing that {claim}. Is there any truth to it?"],
           claim=["you need eight glasses of water a day", "eating late at night makes you gain weight",
                  "you should never wake a sleepwalker", "you should take 10,000 steps a day",
                  "cracking your knuckles causes arthritis", "breakfast is the most important meal of the day",
                  "you lose most of your body heat through your head", "sugar makes kids hyperactive",
                  "reading in dim light damages your eyes", "you shouldn't swim right after eating",
                  "you should wait until you're thirsty to drink water", "naps make you more tired",
                  "eating carrots improves your eyesight", "you can catch up on sleep at the weekend"]),
), contexts=("I'm a night-shift nurse.", "I work at a desk all day.", "I'm 52 and haven't exercised in years.",
             "I have two toddlers and very little free time.", "I'm a university student living in a dorm."),
   constraints=("I'm not looking for medical advice, just general information.", "Keep it short, please.",
                "Please keep it simple."))

_TECH = _Kind("tech", (
    _group(["How do I {task}?", "What's the easiest way to {task}?", "Can you walk me through how to {task}?",
            "I can't figure out how to {task}. Can you help?"],
           task=["free up storage space on my iPhone", "set up two-step verification on my email",
                 "back up the photos on my Android phone to my computer", "share my Wi-Fi password with a guest",
                 "make a table of contents in Google Docs", "use VLOOKUP in Excel",
                 "turn off notifications on my laptop during work hours", "save a Word document as a PDF",
                 "mute a WhatsApp group without leaving it", "set up parental controls on a tablet",
                 "record my screen on Windows", "stop Chrome from opening old tabs when it starts",
                 "find my lost phone from a computer", "print double-sided from a Mac",
                 "connect Bluetooth headphones to my laptop", "block spam calls on my phone",
                 "move my contacts from an old phone to a new one", "add subtitles to a video",
                 "make a shared calendar for my family", "schedule an email to send later in Gmail",
                 "freeze the top row in a spreadsheet", "change the default browser on my computer",
                 "make the text bigger on my phone",
                 "set up a printer on my home Wi-Fi", "send a large video file to a friend",
                 "make a simple budget spreadsheet", "sync my calendar between my phone and laptop",
                 "turn on dark mode on my laptop", "update the apps on my phone automatically",
                 "take a screenshot on a Chromebook", "password-protect a PDF", "clear the cache in my browser",
                 "set an out-of-office reply in Outlook"]),
    _group(["{Problem}. What can I try?", "{Problem}. How can I fix it myself?", "Any idea why {problem}?",
            "{Problem}, and I'm not very technical. Where do I start?",
            "Help! {Problem}. Is there a quick fix?"],
           problem=["my smart speaker keeps mishearing me", "my phone battery is dead by lunchtime",
                    "my Wi-Fi keeps dropping in the evenings", "my printer says it's offline even though it's on",
                    "the apps on my smart TV take forever to load", "my computer takes five minutes to start up",
                    "my phone only charges if I hold the cable at an angle", "my wireless mouse keeps freezing",
                    "my laptop won't connect to the projector at work", "my emails to customers keep going to spam",
                    "my phone keeps saying the storage is full", "my video calls keep freezing",
                    "my keyboard types the wrong symbols",
                    "my computer's clock is always a few minutes wrong",
                    "my phone screen rotates when I don't want it to",
                    "my headphones only play sound in one ear", "my photos aren't backing up to the cloud",
                    "the sound on my TV is out of sync with the picture", "my tablet is suddenly very slow"]),
), contexts=("I'm not very good with technology.", "I'm 70 and my grandkids usually help me with this.",
             "I've looked online, but the guides are confusing."),
   constraints=("Explain it in simple steps.", "Please avoid jargon."))

_KINDS = (_ADVICE, _EXPLAIN, _CREATIVE, _COMPARE, _HOWTO, _HISTORY, _REWRITE, _PLAN, _MESSAGE, _SUMMARY, _IDEAS,
          _OPINION, _CAREER, _HEALTH, _TECH)
#: The kinds of request, in the order they take turns.
KINDS = tuple(kind.name for kind in _KINDS)


def chat_request_prompts(num: int, seed: int = 0, guard: EvalOverlapGuard | None = None) -> list[Prompt]:
    """``num`` distinct requests (fewer only when the tables run out), the kinds taking turns round-robin.

    Deterministic for a seed; de-duplicated after normalisation; a request the ``guard`` flags is never returned.
    Categories are ``"request-<kind>"``.
    """
    rng = random.Random(seed)
    active = list(_KINDS)
    seen: set[str] = set()
    prompts: list[Prompt] = []
    turn = 0
    while len(prompts) < num and active:
        kind = active[turn % len(active)]
        for _ in range(_MAX_TRIES):
            text = _compose(kind, rng)
            key = _normalise(text)
            if key not in seen and (guard is None or not guard.overlaps(text)):
                seen.add(key)
                prompts.append(Prompt((text,), f"request-{kind.name}"))
                turn += 1
                break
        else:  # this kind's tables are used up: the others share its turns from now on
            active.remove(kind)
            logger.info("chat requests: the %r kind ran out after %d requests", kind.name,
                        sum(p.category == f"request-{kind.name}" for p in prompts))
    if len(prompts) < num:
        logger.warning("only %d distinct chat requests (asked for %d)", len(prompts), num)
    return prompts
