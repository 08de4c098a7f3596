"""Texts a user pastes into a chat request: sentences to rewrite and short paragraphs to summarise.

Written for :mod:`.chat_requests` (not copied from any data set), so the requests built around them are new text;
they cover notices, news, work updates and everyday science, the things people paste into a chat assistant.
"""

#: One sentence each, in registers worth changing: curt, stiff, sloppy, passive-aggressive, plain.
SENTENCES = [
    "You left the kitchen a mess again, and I'm tired of cleaning up after you.",
    "We regret to inform you that your application has not been successful.",
    "hey can u send me the file asap, need it for the meeting",
    "The meeting has been moved to Thursday because half the team is out sick.",
    "I think your idea is bad and it will waste our money.",
    "Please ensure all dishes are washed and returned to the cupboard before leaving the kitchen.",
    "Our new app helps you track your spending and save more every month.",
    "I can't come to your party on Saturday because I have to work.",
    "The package will arrive between 9 and 5, and someone must be home to sign for it.",
    "The food was fine but the service was really slow.", "Thanks for the gift, I'll probably use it sometime.",
    "You forgot to water the plants again and now they're dead.",
    "The library will be closed on Monday for staff training.",
    "I am writing to complain about the noise coming from your flat late at night.",
    "Our team beat its sales target by 12 percent this quarter.",
    "Could you maybe possibly look at my essay if you have any time at all?",
    "The printer on the second floor is broken, please use the one downstairs.",
    "I have decided to leave the company at the end of next month.",
    "Your subscription will renew automatically unless you cancel it.",
    "The bus was late, it was raining, and I missed the start of my exam.",
    "We need volunteers to help clean up the park this Sunday morning.",
    "I'm sorry I snapped at you yesterday, I was tired and stressed.",
    "The survey shows that most customers want longer opening hours.",
    "Don't park in front of the garage door or your car will be towed.",
    "Grandma's lasagne is the best thing I have ever eaten.",
    "Employees must complete the safety training before using the new machines.",
    "It was a long day, the train was packed, and all I want is a cup of tea.",
    "Our café now serves oat milk at no extra charge.", "Could you please stop leaving your bike in the hallway?",
    "The project is behind schedule because the supplier delivered the wrong parts.",
    "I loved the book, but the ending felt rushed.",
    "Due to unforeseen circumstances, tonight's concert has been cancelled.",
    "Kids, dinner is ready and it's getting cold!",
    "I would like to request two days of leave next week for a family matter.",
    "The hike was steep, but the view from the top made it worth it.",
    "Your order has shipped and should arrive within three working days.",
    "I don't really understand why we need another meeting about this.",
    "The new recycling bins are collected every other Tuesday.",
    "Honestly, the movie was way too long and kind of boring.",
    "Thank you all for coming tonight, it means a lot to us.",
]

#: Forty to seventy words each: local notices, work updates, news items and explanations.
PARAGRAPHS = [
    "The town council has approved a plan to turn the old bus depot on Mill Road into a covered market. Work will "
    "begin in March and should take about a year. Around forty stalls will be available, with priority given to local "
    "food producers. Some residents are worried about parking, and the council says it will publish a traffic study "
    "before construction starts.",
    "Octopuses have three hearts and blue blood. Two of the hearts pump blood through the gills, while the third "
    "sends it around the rest of the body. Their blood uses a copper-based molecule to carry oxygen, which works "
    "better than iron-based blood in cold water with little oxygen, but less well when the water is warm.",
    "Starting next month, the office will move to a hybrid schedule. Everyone is expected in on Tuesdays and "
    "Thursdays for team meetings, and the other days can be worked from home. Desks will no longer be assigned; "
    "instead, staff can book one through the new app. Lockers on the ground floor are available for anyone who needs "
    "to store equipment.",
    "Our school's reading challenge ended last Friday. Over six weeks, students read a total of 3,412 books, beating "
    "last year's number by almost 800. Year 4 read the most books per student, and the most popular title was a "
    "graphic novel about a time-travelling dog. Prizes will be handed out at Monday's assembly, and parents are "
    "welcome to attend.",
    "Yogurt is made by warming milk and stirring in a spoonful of yogurt that is still alive with bacteria. Kept "
    "warm for several hours, the bacteria turn the milk's sugar into acid, which thickens the milk and gives it its "
    "tang. The longer it is left, the thicker and more sour it becomes.",
    "The library's self-service machine has been out of order since the storm last week. Until it is repaired, "
    "please check out books at the front desk. Returns can still be left in the outdoor drop box, which is emptied "
    "twice a day. We apologise for the longer queues and thank everyone for their patience.",
    "In 1928, Alexander Fleming came back from a holiday to find mould growing on one of his dishes of bacteria. "
    "Around the mould, the bacteria had died. He called the substance penicillin, but it took more than ten years "
    "before other scientists found a way to make it in large amounts. By the end of the Second World War, it was "
    "saving thousands of lives.",
    "Feedback from the spring customer survey was mostly positive. Shoppers liked the new store layout and the wider "
    "range of fresh produce. The most common complaint was the wait at the checkout on weekday lunchtimes, so "
    "management will open two extra tills between noon and two o'clock and repeat the survey in the autumn.",
    "Honeybees tell each other where to find food with a movement called the waggle dance. A bee that has found "
    "flowers returns to the hive and walks in a figure-of-eight, shaking its body during the straight part. The angle "
    "of that straight run shows the direction, and its length tells the other bees how far away the flowers are.",
    "The cycling club's ride to the lakes has been moved from the 14th to the 21st because of the forecast. The "
    "meeting point and time stay the same: the station car park at half past seven. Anyone who can no longer come "
    "should tell Dana by Wednesday so the minibus booking can be changed. Remember to bring a spare inner tube and a "
    "packed lunch.",
    "Many people believe goldfish only remember things for a few seconds, but experiments show otherwise. Goldfish "
    "have been trained to push levers for food and to respond to sounds, and they remembered these tasks for months. "
    "Some even learned to expect food at a particular time of day.",
    "After two years of planning, the community garden on Elm Street is finally open. It has twenty raised beds, a "
    "shared tool shed and a rainwater tank. Beds are rented for a small yearly fee, and five are set aside for the "
    "primary school next door. A workshop on growing tomatoes will be held on the first Saturday of every month.",
    "The so-called garbage patch in the Pacific is not a solid island of rubbish, as many people imagine. It is a huge "
    "area of ocean where currents gather plastic, much of it broken into tiny pieces that are hard to see from a "
    "boat. Old fishing nets make up a large share of the bigger pieces, and cleaning it up is hard because everything "
    "is spread so thinly.",
    "Our quarterly results show revenue up eight percent on last year, mainly thanks to online sales. Costs also "
    "rose, largely because of higher shipping prices, so profit grew by only two percent. Next quarter the team will "
    "focus on cutting returns, which currently make up almost a fifth of online orders.",
    "Tomatoes reached Europe from the Americas in the sixteenth century. For a long time, many Europeans grew them "
    "only as decorative plants, partly because they belong to the same family as some poisonous plants. It took "
    "another two hundred years for tomatoes to become an everyday food in most of Europe.",
    "The water in our building will be shut off on Thursday from nine in the morning until about three in the "
    "afternoon while the main pipe is replaced. Residents are advised to fill a few bottles beforehand. The lift will "
    "work as usual. If the work runs late, a notice will be posted in the entrance hall.",
    "Sleep researchers say the hour before bed matters more than people think. Bright screens, heavy meals and hard "
    "exercise late in the evening can all make it harder to fall asleep. Keeping the bedroom cool and dark, and "
    "going to bed at about the same time every night, are among the simplest changes that help.",
    "Volunteers are needed for this year's charity fun run on Sunday the 12th. Jobs include handing out water, "
    "marshalling the route and helping at the finish line. Shifts last about three hours, and every volunteer gets a "
    "free T-shirt and lunch. To sign up, reply to this email with the role you'd like and your T-shirt size.",
    "The first bicycles, built in the early 1800s, had no pedals. Riders sat on a wooden frame and pushed themselves "
    "along with their feet. Pedals were later fixed to the front wheel, which led to the high-wheelers with their "
    "huge front wheels. The safer design we know today, with two equal wheels and a chain, caught on in the 1880s.",
    "Our team tried three project-management tools over a month. The first was the easiest to learn but had weak "
    "reporting. The second had every feature we wanted but confused most people. The third was a good middle ground "
    "and cost the least, so we recommend switching to it next quarter, with a short training session for everyone.",
    "Moss can grow where few other plants survive, such as on bare rock and roof tiles. It has no roots, only tiny "
    "threads that hold it in place, and it takes in water through its leaves. When it dries out, many kinds of moss "
    "can rest for months and then turn green again within hours of rain.",
    "The museum will be closed for renovation from June until the end of September. During that time, part of the "
    "collection will go on tour to three other cities, and the café will stay open for takeaway. When the museum "
    "reopens, it will have a new children's wing, a bigger shop and step-free access to every floor.",
    "A small study of office workers found that short walks during the day lifted their mood more than the same "
    "time spent on coffee breaks. People who walked for five minutes every hour reported more energy and less "
    "tiredness in the afternoon. The researchers point out that the study was small and lasted only a few weeks.",
    "The Rosetta Stone, found in Egypt in 1799, carries the same decree in three scripts: hieroglyphs, a later "
    "Egyptian script and ancient Greek. Because scholars could read the Greek, they could compare it with the other "
    "two. In the 1820s, this helped Champollion work out how hieroglyphs were read.",
    "Hi everyone, just a reminder that the office fridge will be cleared out this Friday at four o'clock. Anything "
    "left inside without a name and date will be thrown away. Please also take home any containers you've left in "
    "the cupboards. Thanks for helping keep the kitchen clean for everyone.",
    "Compound interest means you earn interest not only on the money you put in but also on the interest it has "
    "already earned. Over a few years the difference is small, but over decades it grows large. That is why people "
    "often say that starting to save early matters more than saving a lot later.",
    "The local swimming pool is changing its timetable from next week. Early lane swimming will start at half past "
    "six instead of seven, and the Saturday family session moves to the afternoon. Children's lessons stay the same. "
    "The pool is also introducing a monthly pass that costs less than ten single visits.",
    "Camels do not store water in their humps, despite what many people think. The humps hold fat, which the animal "
    "can use for energy when food is scarce. Camels cope with the desert because their bodies lose very little "
    "water: they barely sweat until it gets very hot, and their kidneys save as much water as possible.",
    "Our neighbourhood association met on Tuesday to talk about speeding on Oak Avenue. Residents agreed to ask the "
    "city for two speed bumps and a new crossing near the playground. A petition will go round next week, and anyone "
    "who wants to help collect signatures can contact the association's secretary.",
    "Printing with movable type made books far cheaper to produce. Before it, most books in Europe were copied by "
    "hand, which could take months. Within fifty years of the first presses appearing in Germany, millions of books "
    "had been printed, helping new ideas in science, religion and politics spread much faster.",
    "The airline has changed its baggage rules. From the first of July, the basic fare includes only one small bag "
    "that fits under the seat. A larger cabin bag now costs extra and must be booked in advance, while checked bags "
    "can still be added up to two hours before departure. Passengers who booked before the change keep their old "
    "allowance.",
    "Thunderstorms form when warm, moist air rises quickly into colder air. As it rises, the water vapour cools into "
    "droplets and builds tall clouds. Inside them, bits of ice and water collide and build up electric charge. When "
    "the charge becomes large enough, it is released as lightning, and the sudden heating of the air makes thunder.",
]
